"""The `appliance` command: train, eval, export, bench.

Flags of `train` are generated from config.TrainConfig, so the config file and the command line
share one typed schema. User errors print as `error: ...` lines and exit 1, without a traceback.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from . import config as C
from .errors import ApplianceError, cause_chain


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ApplianceError as e:
            for line in str(cause_chain(e)[-1]).splitlines() or [type(e).__name__]:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """Fine-tune Llama-family models larger than one GPU by streaming blocks from host memory."""


def _train_options(fn):
    """One click option per TrainConfig field (defaults None: unset flags don't override files).

    Values reach config.build_config as the strings typed: it converts and checks them all, so
    every bad flag is reported at once (click's own types stop at the first). The metavar still
    shows the type or the choices in --help."""
    for name in reversed(list(C.FIELDS)):
        f = C.FIELDS[name]
        if not f.metadata.get("cli", True):
            continue
        kind = C.base_type(name)
        help_text = f.metadata["help"]
        if f.default is not None and kind is not bool:
            shown = ",".join(f.default) if kind is tuple else f.default
            help_text += f"  [default: {shown}]"
        if kind is bool:
            opt = click.option(C.flag(name), name, is_flag=True, default=None, help=help_text)
        else:
            metavar = {int: "INTEGER", float: "FLOAT", tuple: "LIST"}.get(kind, "TEXT")
            if name in C.CHOICES:
                metavar = "[" + "|".join(C.CHOICES[name]) + "]"
            opt = click.option(
                C.flag(name), name, type=str, default=None, metavar=metavar, help=help_text
            )
        fn = opt(fn)
    return fn


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML file whose keys are the flags below (with underscores).",
)
@click.option(
    "--cluster",
    "cluster",
    is_flag=False,
    flag_value="auto",
    default=None,
    help="Run on an existing Ray cluster: ADDRESS, or bare for $RAY_ADDRESS.",
)
@_train_options
@friendly_errors
def train(config_file: str | None, **flags) -> None:
    """Fine-tune a LoRA adapter. With no --model: the built-in demo on embedded Ray (its own
    model, corpus and settings; a config file and flags still override its settings)."""
    from .driver import train as run_train

    file_values = C.read_config_file(config_file) if config_file else {}
    cfg = C.build_config(file_values, flags, source=f"--config {config_file}")
    run_train(cfg)


@main.command("eval")
@click.option("--model", required=True, help="Base model directory or s3:// prefix.")
@click.option("--adapter", default=None, help="LoRA adapter directory (PEFT format).")
@click.option(
    "--data",
    required=True,
    help="Data as train reads it: .jsonl/.parquet/.txt or a directory of them (text, "
    "prompt + completion, or conversations); scored on the targets training uses.",
)
@click.option("--seq-len", type=int, required=True, help="Truncate each record to N tokens.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(C.CHOICES["dtype"]), default="auto")
@click.option(
    "--chat-template",
    default=None,
    help="Jinja chat template file for conversation records, instead of the model's.",
)
@friendly_errors
def eval_cmd(
    model: str,
    adapter: str | None,
    data: str,
    seq_len: int,
    device: str,
    dtype: str,
    chat_template: str | None = None,
):
    """Print {"loss": mean next-token NLL, "tokens": target tokens} as one JSON line."""
    from . import storage
    from .blocks import dtype_from_name
    from .evaluate import evaluate
    from .trainer import resolve_device, resolve_dtype

    dev = resolve_device(device)
    result = evaluate(
        storage.localize(model),
        storage.localize(data),
        seq_len,
        adapter_dir=storage.localize(adapter) if adapter else None,
        device=dev,
        dtype=dtype_from_name(resolve_dtype(dtype, dev)),
        chat_template=chat_template,
    )
    click.echo(json.dumps(result))


@main.command()
@click.option("--model", required=True, help="Base model directory or s3:// prefix.")
@click.option("--adapter", required=True, help="LoRA adapter directory (PEFT format).")
@click.option("--output", required=True, help="Directory for the merged checkpoint (new).")
@friendly_errors
def export(model: str, adapter: str, output: str) -> None:
    """Write base + adapter merged into a Hugging Face checkpoint."""
    from . import storage
    from .export import export_merged

    export_merged(storage.localize(model), storage.localize(adapter), output)
    click.echo(f"merged checkpoint written to {output}")


@main.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def bench(options: tuple[str, ...]) -> None:
    """Streamed vs resident step time against the floor max(2W/B_h2d, F/P) (--help: options)."""
    from . import bench as B

    # one parser for both entry points: bench's own (`python -m appliance.bench`)
    sys.exit(B.main(list(options), prog="appliance bench"))


if __name__ == "__main__":
    main()
