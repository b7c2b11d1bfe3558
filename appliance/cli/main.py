"""The `appliance` command: train, eval, generate, export, bench, plan, doctor.

Flags of `train` are generated from config.TrainConfig, so the config file and the command line
share one typed schema. User errors print as `error: ...` lines and exit 1, without a traceback.

Each command imports the package that does its work inside its function (start-up time: `appliance
--help`, `plan` or `doctor` do not load the run's Ray side, the engine or the exporter). These are
the only imports of the package's own modules kept inside functions, with quant/reference.py's
kernels (a C extension that may not be built, Triton) and run.train (the same reason as here).
"""

from __future__ import annotations

import functools
import json
import math
import sys

import click

from appliance.config import (
    CHOICES,
    DEFAULT_METRICS_PORT,
    FIELDS,
    HELP_GROUPS,
    KEY_ALIASES,
    TrainConfig,
    base_type,
    build_config,
    flag,
    read_config_file,
)
from appliance.errors import ApplianceError, ConfigError, cause_chain
from appliance.hardware.gpus import GPUS as GPU_CLASSES
from appliance.interrupt import RunInterrupted, stopped_at_once


def _check_values(kwargs: dict) -> None:
    """Any command's options: a NUL byte (os calls raise a bare ValueError on one) or a number
    that is not finite (nan passes every range check) is one line naming the option."""
    problems = []
    for name, value in kwargs.items():
        option = "--" + name.replace("_", "-")
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, str) and "\0" in v:
                problems.append(f"{option}: {v!r} holds a NUL byte: give it without one")
            elif isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{option}: {v} is not a finite number")
    if problems:
        raise ConfigError("\n".join(problems))


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _check_values(kwargs)
            return fn(*args, **kwargs)
        except ApplianceError as e:
            for line in str(cause_chain(e)[-1]).splitlines() or [type(e).__name__]:
                click.echo(f"error: {line}", err=True)
            sys.exit(1)
        except RunInterrupted as e:  # stopped at a step boundary, checkpoint written
            click.echo(str(e), err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except SystemError as e:  # a Ctrl-C inside Ray's Cython code comes out as one
            if not stopped_at_once(e):
                raise
            click.echo("interrupted", err=True)
            sys.exit(130)
        except ModuleNotFoundError as e:  # a dependency left out (pip --no-deps, a GPU image)
            package = (e.name or "").partition(".")[0]
            if package not in MISSING_HINTS:
                raise
            command = click.get_current_context().info_name
            click.echo(f"error: `appliance {command}` needs {MISSING_HINTS[package]}", err=True)
            sys.exit(1)

    return wrapper


# dependencies whose absence is an install to fix, not a bug: what to install, and what runs
# without it (the GPU machine's image has neither Ray nor boto3)
_BOTO3_HINT = "boto3 for s3:// paths, which is not installed here: pip install 'boto3>=1.34'"
MISSING_HINTS = {
    "ray": "Ray, which is not installed here: pip install 'ray[default]>=2.40' "
    "(eval and bench run without it)",
    "boto3": _BOTO3_HINT,
    "botocore": _BOTO3_HINT,  # boto3's own dependency, missing with it
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("appliance")
    except PackageNotFoundError:
        return "unknown"


class PatternHint(click.Command):
    """A command taking --data: "unexpected extra arguments" after it is, nearly always, a glob
    pattern left unquoted that the shell expanded into file names; the error says so."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = any(a == "--data" or a.startswith("--data=") for a in args)
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:  # --learning-rate: the appliance's own name, --lr
            own = KEY_ALIASES.get(e.option_name.lstrip("-").replace("-", "_"))
            if own and any(own == p.name for p in self.params):
                e.possibilities = [flag(own)]
            raise
        except click.UsageError as e:
            if given and "unexpected extra argument" in e.message:
                e.message += (
                    ": if --data is a pattern, quote it, or the shell expands it into file names "
                    "(--data 'data/*.jsonl')"
                )
            raise


class GroupedHelp(PatternHint):
    """A command whose --help lists its options in the sections of config.HELP_GROUPS (in that
    order), then whatever no group names under "Other options"."""

    ALIASES = {"config_file": "config"}  # click parameter name -> the name HELP_GROUPS uses

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                records[self.ALIASES.get(param.name or "", param.name or "")] = record
        for title, names in [*HELP_GROUPS.items(), ("Other options", tuple(records))]:
            rows = [records.pop(n) for n in names if n in records]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(_version(), "--version", "-V", prog_name="appliance")
def main() -> None:
    """Fine-tune LoRA and QLoRA adapters for models larger than one GPU (Llama, Mistral, Qwen2/3,
    Gemma 2/3, Phi-3) by streaming their blocks from host memory."""


METAVARS = {"micro_batches_per_step": "[N|auto]"}  # fields whose type alone misleads


def _train_options(fn):
    """One click option per TrainConfig field (defaults None: unset flags don't override files).

    Values reach config.build_config as the strings typed: it converts and checks them all, so
    every bad flag is reported at once (click's own types stop at the first). The metavar still
    shows the type or the choices in --help."""
    for name in reversed(list(FIELDS)):
        f = FIELDS[name]
        if not f.metadata.get("cli", True):
            continue
        kind = base_type(name)
        help_text = f.metadata["help"]
        if f.default is not None and kind is not bool:
            shown = (",".join(f.default) or "none") if kind is tuple else f.default
            help_text += f"  [default: {shown}]"
        if kind is bool:
            opt = click.option(flag(name), name, is_flag=True, default=None, help=help_text)
        elif f.metadata.get("multiple"):  # --report-to a --report-to b: () when not given
            opt = click.option(
                flag(name), name, type=str, multiple=True, metavar="LIST", help=help_text,
                callback=lambda ctx, param, value: value or None,
            )  # fmt: skip
        else:
            metavar = {int: "INTEGER", float: "FLOAT", tuple: "LIST"}.get(kind, "TEXT")
            if name in CHOICES:
                metavar = "[" + "|".join(CHOICES[name]) + "]"
            metavar = METAVARS.get(name, metavar)
            opt = click.option(
                flag(name), name, type=str, default=None, metavar=metavar, help=help_text
            )
        fn = opt(fn)
    return fn


@main.command(cls=GroupedHelp)
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
    model, corpus and settings; a config file and flags still override its settings).

    `--output O --resume` alone continues the run recorded in O/run.json; flags beside it change
    what does not break that run (--steps, --log-format, --metrics-port, ...). Flags override
    the config file, which overrides the recorded run."""
    from appliance.run.driver import train as run_train
    from appliance.run.record import rebuild_unreadable_run_file
    from appliance.run.resume import recorded_config

    file_values = read_config_file(config_file) if config_file else {}
    run_values, output = None, flags.get("output") or file_values.get("output")
    resuming = any(v.get(k) for v in (flags, file_values) for k in ("resume", "auto_resume"))
    notes: list[str] = []
    if resuming and output:  # (auto_resume: None when there is no run.json)
        if rebuilt := rebuild_unreadable_run_file(str(output)):
            notes.append(rebuilt)
        run_values = recorded_config(str(output))
    cfg = build_config(
        file_values,
        flags,
        source=f"--config {config_file}",
        run_values=run_values,
        run_source=f"{output}/run.json",
        notes=notes,
    )
    for line in notes:
        click.echo(f"note: {line}", err=True)
    run_train(cfg)


_MODEL_HELP = (
    "Base model: a directory, an s3:// prefix, or a Hugging Face id (org/name) that is in the "
    "local Hugging Face cache. Default with --adapter: the model its run trained on (run.json, "
    "or a checkpoint's config.json), else the one its adapter_config.json names."
)
_ADAPTER_HELP = (
    "LoRA adapter directory (PEFT format): a run's --output, one of its checkpoints "
    "(OUTPUT/checkpoints/step-N), or any PEFT adapter; local or s3://."
)


QUIET = ("base_quant", "dtype")  # taken from the run, but said only when not train's default


def adapter_defaults(adapter: str, adapter_dir, given: dict, device: str | None = None) -> dict:
    """`given` with the options left out (None: model, seq_len, chat_template, data, base_quant,
    dtype) filled from the run that wrote the adapter (`adapter`, fetched into `adapter_dir`),
    and a note saying so; a model from its adapter_config.json when it has no run. `data` is the
    run's validation set: its --eval-data, or its --data with `eval_split` and `seed` (the
    documents they held out) added; `dtype` only when the run ran on `device`'s kind (a GPU run's
    bfloat16 is no choice for a CPU). A missing --model, --seq-len or --data with nothing to take
    it from, or a local path taken that is gone, is an error naming the flag."""
    from pathlib import Path

    from appliance.errors import ConfigError
    from appliance.models.lora import ADAPTER_CONFIG
    from appliance.run.record import adapter_run_config
    from appliance.storage import uri as storage
    from appliance.storage.checkpoints import json_object
    from appliance.storage.globs import has_glob, split_glob
    from appliance.storage.hub import is_hub_id

    if adapter_dir.is_file():  # adapter_model.safetensors, say, rather than its directory
        hint = f": did you mean {adapter_dir.parent}?"
        hint = hint if (adapter_dir.parent / ADAPTER_CONFIG).is_file() else ""
        raise ConfigError(f"--adapter must be a directory (the one holding {ADAPTER_CONFIG}){hint}")
    given, found, taken = dict(given), adapter_run_config(adapter_dir), {}
    config, source = found if found else ({}, None)
    if source is not None and storage.is_s3(adapter):  # named as given, not as its local copy
        source = storage.join(adapter, Path(source).relative_to(adapter_dir).as_posix())
    if found is None and given.get("model") is None:  # a PEFT adapter: the model it names
        named = json_object(adapter_dir / ADAPTER_CONFIG) or {}
        base, revision = named.get("base_model_name_or_path"), named.get("revision")
        if isinstance(base, str) and base:
            config = {"model": f"{base}@{revision}" if revision else base}
            source = f"{adapter}/{ADAPTER_CONFIG}"
    split = None if config.get("eval_data") else config.get("eval_split")
    known = {**config, "data": config.get("data") if split else config.get("eval_data")}
    if device is not None and config.get("device", "auto") not in ("auto", device):
        known.pop("dtype", None)  # chosen for another kind of device: this one's auto instead
    for key, value in given.items():
        if value is None and known.get(key) not in (None, []):
            given[key] = taken[key] = known[key]
    if "data" in taken and split:
        given["eval_split"], given["seed"] = split, config.get("seed", TrainConfig.seed)
        taken["data"] += f" (the {split} of it that --seed {given['seed']} held out)"
    no_run = f"{adapter} holds no run record (run.json, or a checkpoint's config.json)"
    for key in ("model", "seq_len", "data"):
        if key not in given or given[key] is not None:
            continue
        if key == "model":
            why = f"{no_run}, nor does its {ADAPTER_CONFIG} name a base model"
        elif key == "data" and found:
            why = f"the run of {adapter} had no validation set (--eval-data or --eval-split)"
            why += " to take it from"
        else:
            why = f"{no_run} to take it from"
        raise ConfigError(f"{flag(key)} needed: {why}")
    for key in ("model", "data"):  # a local path taken from the run, moved since
        value = given[key] if key in taken else None
        if value and not storage.is_s3(value) and not is_hub_id(value):
            if not Path(split_glob(value)[0] if has_glob(value) else value).exists():
                raise ConfigError(
                    f"{flag(key)} {value} (from {source}) is not there any more: if it moved, "
                    f"give its new place with {flag(key)} PATH"
                )
    said = {k: v for k, v in taken.items() if k not in QUIET or v != FIELDS[k].default}
    if said:
        shown = " ".join(f"{flag(k)} {v}" for k, v in said.items())
        click.echo(f"note: {shown} (from {source})", err=True)
    return given


@main.command(
    "eval", cls=PatternHint, short_help="Mean next-token loss of a model (and adapter) on a file."
)
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", default=None, help=_ADAPTER_HELP)
@click.option(
    "--data",
    default=None,
    help="Data as train reads it: .jsonl/.json/.parquet/.arrow/.txt (compressed too), a dir of "
    "them, a glob pattern, s3:// or a cached Hugging Face dataset id (text, prompt + "
    "completion, or conversations); scored on the targets training uses. Default with "
    "--adapter: its run's validation set (--eval-data, or the documents --eval-split held out).",
)
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help="Truncate each record to N tokens (default with --adapter: its run's --seq-len).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where to evaluate: auto takes CUDA when a GPU is visible.",
)
@click.option(
    "--dtype",
    type=click.Choice(CHOICES["dtype"]),
    default=None,
    help="Compute dtype: auto is bfloat16 on GPU (float16 without bf16), float32 on CPU (default: "
    "auto; with --adapter, its run's --dtype).",
)
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default=None,
    help="Quantize the base model's linear weights, as `train --base-quant` (default: none; with "
    "--adapter, its run's, so a QLoRA run's adapter is scored as it trained: give none for the "
    "unquantized base).",
)
@click.option(
    "--chat-template",
    default=None,
    help="Chat template for conversation records instead of the model's: a built-in name "
    "(chatml, llama3, gemma, mistral) or a jinja file (default with --adapter: its run's "
    "--chat-template).",
)
@click.option(
    "--on-bad-record",
    type=click.Choice(CHOICES["on_bad_record"]),
    default="fail",
    show_default=True,
    help="A malformed record: stop naming it (fail), or leave it out with a warning (skip).",
)
@click.option("--field-messages", default=None, help=FIELDS["field_messages"].metadata["help"])
@click.option(
    "--message-property-mappings",
    default=None,
    help=FIELDS["message_property_mappings"].metadata["help"],
)
@click.option("--roles", default=None, help=FIELDS["roles"].metadata["help"])
@click.option(
    "--no-base",
    is_flag=True,
    help="With --adapter, score the adapter alone (by default the base model's loss is given "
    "beside it: base_loss, base_perplexity).",
)
@friendly_errors
def eval_cmd(
    model: str | None,
    adapter: str | None,
    data: str | None,
    seq_len: int | None,
    device: str,
    dtype: str | None,
    base_quant: str | None,
    chat_template: str | None = None,
    on_bad_record: str = "fail",
    field_messages: str | None = None,
    message_property_mappings: str | None = None,
    roles: str | None = None,
    no_base: bool = False,
):
    """Print {"loss": mean next-token NLL, "tokens": target tokens, "perplexity"} as one JSON
    line; with --adapter also the base model's "base_loss" and "base_perplexity"."""
    from appliance.actors.trainer import resolve_device, resolve_dtype
    from appliance.adapter.evaluate import check_device, evaluate
    from appliance.data.files import dataset_notes, resolve_dataset
    from appliance.data.records import Holdout
    from appliance.engine.blocks import dtype_from_name
    from appliance.run.record import other_model_note
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_data, localize_model

    dev = resolve_device(device)
    check_device(dev)  # before resolve_dtype asks the GPU what it computes
    adapter_dir = localize_adapter(adapter) if adapter else None
    holdout = None
    if adapter:
        given = {"model": model, "seq_len": seq_len, "chat_template": chat_template, "data": data,
                 "base_quant": base_quant, "dtype": dtype, "field_messages": field_messages,
                 "message_property_mappings": message_property_mappings,
                 "roles": roles}  # fmt: skip
        filled = adapter_defaults(adapter, adapter_dir, given, device=dev)
        model, seq_len, chat_template, data, base_quant, dtype = (
            filled[k] for k in list(given)[:6]
        )
        field_messages, message_property_mappings, roles = (filled[k] for k in list(given)[6:])
        if "eval_split" in filled:  # the documents the run held out of its --data
            holdout = Holdout(filled["eval_split"], filled["seed"], held_out=True)
    else:
        flags = (("--model", model), ("--data", data), ("--seq-len", seq_len))
        missing = [flag for flag, value in flags if value is None]
        if missing:
            raise click.UsageError(
                f"{' and '.join(missing)} needed (without --adapter there is no run to take "
                f"{'them' if len(missing) > 1 else 'it'} from)"
            )
    base_quant, dtype = base_quant or TrainConfig.base_quant, dtype or TrainConfig.dtype
    shape = {"field_messages": field_messages, "message_property_mappings":
             message_property_mappings, "roles": roles}  # fmt: skip
    fields = build_config(flag_values={k: v for k, v in shape.items() if v}).field_map()
    model_dir = localize_model(resolve_model(model))  # the model's errors before the data's
    if adapter_dir is not None and (note := other_model_note(adapter_dir, model_dir, model)):
        click.echo(f"note: {note}", err=True)
    data_path = localize_data(resolve_dataset(data))
    for note in dataset_notes(data_path, "--data", data):  # files skipped, several splits
        click.echo(f"note: {note}", err=True)
    result = evaluate(
        model_dir,
        data_path,
        seq_len,
        adapter_dir=adapter_dir,
        device=dev,
        dtype=dtype_from_name(resolve_dtype(dtype, dev)),
        base_quant=base_quant,
        chat_template=chat_template,
        on_bad_record=on_bad_record,
        warn=lambda message: click.echo(f"warning: {message}", err=True),
        holdout=holdout,
        fields=fields,
        with_base=adapter_dir is not None and not no_base,
    )
    click.echo(json.dumps(result))


@main.command(short_help="Answer prompts with a model and an adapter (or a merged export).")
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", default=None, help=_ADAPTER_HELP + " None: the model alone.")
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt (repeat for several).")
@click.option("--prompts", "prompts_file", default=None, help="A file of prompts, one a line.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="0: greedy; above 0, sample at this temperature.",
)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(CHOICES["dtype"]), default=None)
@click.option("--base-quant", type=click.Choice(CHOICES["base_quant"]), default=None)
@click.option(
    "--gpu-memory-budget",
    default=None,
    help="Cap the GPU memory, e.g. 24GiB: blocks (and then the KV caches) beyond it stay in "
    "host memory and stream through the GPU.",
)
@click.option(
    "--chat-template",
    default=None,
    help="Chat template for the prompts: a built-in name (chatml, llama3, gemma, mistral) or a "
    "jinja file (default: the model's; with --adapter, its run's --chat-template).",
)
@click.option(
    "--no-chat-template", is_flag=True, help="Give the prompts as raw text, no chat template."
)
@friendly_errors
def generate(
    model: str | None,
    adapter: str | None,
    prompt_texts: tuple[str, ...],
    prompts_file: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    device: str,
    dtype: str | None,
    base_quant: str | None,
    gpu_memory_budget: str | None,
    chat_template: str | None,
    no_chat_template: bool,
) -> None:
    """Print one JSON line per prompt: {"prompt", "answer", "tokens"}."""
    from pathlib import Path

    from appliance.actors.trainer import resolve_device, resolve_dtype
    from appliance.adapter.evaluate import check_device
    from appliance.adapter.generate import Generator, Sampling
    from appliance.config import parse_bytes
    from appliance.data.chat import ChatError, load_chat_template
    from appliance.engine.blocks import dtype_from_name
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_model

    prompts = list(prompt_texts)
    if prompts_file is not None:
        if not Path(prompts_file).is_file():
            raise ConfigError(f"--prompts {prompts_file}: no such file")
        lines = Path(prompts_file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise click.UsageError("give --prompt TEXT (repeatable) or --prompts FILE")
    problems = [
        f"{name} must be {rule} (got {value})"
        for name, value, ok, rule in (
            ("--max-new-tokens", max_new_tokens, max_new_tokens >= 1, "≥ 1"),
            ("--temperature", temperature, temperature >= 0, "≥ 0"),
            ("--top-p", top_p, 0 < top_p <= 1, "in (0, 1]"),
        )
        if not ok
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    dev = resolve_device(device)
    check_device(dev)
    adapter_dir = localize_adapter(adapter) if adapter else None
    if adapter:
        given = {"model": model, "chat_template": chat_template, "base_quant": base_quant,
                 "dtype": dtype}  # fmt: skip
        filled = adapter_defaults(adapter, adapter_dir, given, device=dev)
        model, chat_template, base_quant, dtype = (filled[k] for k in given)
    elif model is None:
        raise click.UsageError("--model needed (without --adapter there is no run to take it from)")
    try:
        budget = parse_bytes(gpu_memory_budget) if gpu_memory_budget else None
    except ValueError as e:
        raise ConfigError(f"--gpu-memory-budget: {e}") from None
    model_dir = localize_model(resolve_model(model))
    try:
        chat = None if no_chat_template else load_chat_template(model_dir, chat_template)
    except ChatError as e:
        raise ConfigError(str(e)) from None
    gen = Generator(
        model_dir,
        adapter_dir,
        device=dev,
        dtype=dtype_from_name(resolve_dtype(dtype or TrainConfig.dtype, dev)),
        base_quant=base_quant or TrainConfig.base_quant,
        chat=chat,
        gpu_memory_budget=budget,
    )
    try:
        ids = [gen.encode(p) for p in prompts]
        outs = gen.generate(ids, Sampling(max_new_tokens, temperature, top_p, seed))
    finally:
        gen.close()
    for prompt, out in zip(prompts, outs, strict=True):
        answer = gen.decode([t for t in out if t not in gen.stop_ids])
        click.echo(json.dumps({"prompt": prompt, "answer": answer, "tokens": len(out)}))


@main.command()
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", required=True, help=_ADAPTER_HELP)
@click.option(
    "--output",
    required=True,
    help="Directory for the merged checkpoint (new), or an s3:// prefix (empty).",
)
@friendly_errors
def export(model: str | None, adapter: str, output: str) -> None:
    """Write base + adapter merged into a Hugging Face checkpoint."""
    from appliance.adapter.export import export_to
    from appliance.run.record import other_model_note
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_model

    adapter_dir = localize_adapter(adapter)
    model = adapter_defaults(adapter, adapter_dir, {"model": model})["model"]
    model = resolve_model(model)  # a hub id: its snapshot, which the model card names by the id
    model_dir = localize_model(model)
    if note := other_model_note(adapter_dir, model_dir, model):
        click.echo(f"note: {note}", err=True)
    export_to(model_dir, adapter_dir, output, shown_as=(model, adapter))
    click.echo(f"merged checkpoint written to {output}")


@main.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    short_help="Time the streamed step against its floor and resident training.",
)
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def bench(options: tuple[str, ...]) -> None:
    """Streamed vs resident step time against the floor max(W/B_h2d, F/P) (--help: options)."""
    from appliance.bench.cli import main as bench_main

    # one parser for both entry points: bench's own (`python -m appliance.bench`)
    sys.exit(bench_main(list(options), prog="appliance bench"))


def _help(name: str) -> str:
    """A train flag's help text (config/schema.py), for the same flag of another command."""
    return FIELDS[name].metadata["help"]


PLAN_SHAPE = ("seq_len", "micro_batch_size", "micro_batches_per_step")  # train's defaults
PLAN_DTYPES = tuple(d for d in CHOICES["dtype"] if d != "auto")  # estimate.DTYPES


@main.command("plan", short_help="Memory, time and cost of a run, before renting a GPU.")
@click.option("--model", default=None, help="Model directory or s3:// prefix (config.json only).")
@click.option("--preset", default=None, help="A bench preset instead of --model (tiny, 7b, ...).")
@click.option(
    "--gpu",
    "gpu",
    type=click.Choice(list(GPU_CLASSES), case_sensitive=False),
    required=True,
    help="GPU class: its memory, host link, FLOP rate and instance (docs/plan.md's table).",
)
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs (trainers) on one node.")
@click.option(
    "--seq-len",
    type=int,
    default=TrainConfig.seq_len,
    show_default=True,
    help=_help("seq_len"),
)
@click.option(
    "--micro-batch-size",
    type=int,
    default=TrainConfig.micro_batch_size,
    show_default=True,
    help=_help("micro_batch_size"),
)
@click.option(
    "--micro-batches-per-step",
    default=str(TrainConfig.micro_batches_per_step),
    show_default=True,
    metavar="[N|auto]",
    help="Micro-batches per optimizer step (M), or auto: the smallest M within 10% of "
    "compute-bound that fits.",
)
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default=TrainConfig.base_quant,
    show_default=True,
    help=_help("base_quant"),
)
@click.option(
    "--lora-rank",
    type=int,
    default=TrainConfig.lora_rank,
    show_default=True,
    help=_help("lora_rank").rstrip(".") + ", on all seven projections.",
)
@click.option("--gpu-memory-budget", default=None, help="e.g. 20GiB (default: 90% of the card).")
@click.option("--tokens", type=int, default=None, help="Tokens to train on (for time and cost).")
@click.option("--steps", type=int, default=None, help="Optimizer steps (instead of --tokens).")
@click.option("--price-per-hour", type=float, default=None, help="$ per GPU-hour (default: table).")
@click.option(
    "--dtype",
    type=click.Choice(PLAN_DTYPES),
    default="bfloat16",
    show_default=True,
    help="Compute dtype (train's auto is bfloat16 on a GPU with bf16).",
)
@click.option(
    "--finetuning-type",
    type=click.Choice(CHOICES["finetuning_type"]),
    default=TrainConfig.finetuning_type,
    show_default=True,
    help="full: every weight trains (host memory for masters and moments, gradients device→host, "
    "the CPU's AdamW).",
)
@click.option("--freeze-embeddings", is_flag=True, help=_help("freeze_embeddings"))
@click.option("--h2d-gbps", type=float, default=None, help="Measured B (GB/s), e.g. from doctor.")
@click.option("--tflops", type=float, default=None, help="Measured P (TFLOP/s), e.g. from doctor.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def plan_cmd(model, preset, gpu, micro_batches_per_step, gpu_memory_budget, as_json, **kw) -> None:
    """Memory, time and cost of a run from config.json alone (no weights, no GPU needed).

    The shape defaults to train's (--seq-len, --micro-batch-size, --micro-batches-per-step), so
    `plan --model X` describes `train --model X`. Exits 1 when the run does not fit (GPU memory
    or host RAM), naming what to change."""
    from click.core import ParameterSource

    from appliance.plan.estimate import plan_input
    from appliance.plan.report import run_plan
    from appliance.storage.hub import resolve_model

    ctx = click.get_current_context()
    kw["train_defaults"] = tuple(
        n for n in PLAN_SHAPE if ctx.get_parameter_source(n) == ParameterSource.DEFAULT
    )
    model = resolve_model(model) if model else model  # a hub id: its local-cache snapshot
    p = plan_input(model, preset, gpu, micro_batches_per_step, gpu_memory_budget, **kw)
    sys.exit(0 if run_plan(p, as_json)["fits"] else 1)


@main.command("doctor")
@click.option("--model", default=None, help="Model directory or s3:// prefix (config.json only).")
@click.option("--preset", default=None, help="A bench preset instead of --model.")
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default="none",
    show_default=True,
    help="Count the weight store as train --base-quant would store it.",
)
@click.option(
    "--device",
    type=click.Choice(CHOICES["device"]),
    default="auto",
    show_default=True,
    help="The device train would use: auto takes CUDA when a GPU is visible; cuda fails the "
    "gpus check when none is; cpu skips what only a GPU run needs (page-locking).",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="The metrics port train would be given: checked to be free. Without it, the port train "
    f"takes by default ({DEFAULT_METRICS_PORT}, or the next free one).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def doctor_cmd(model, preset, base_quant, device, metrics_port, as_json) -> None:
    """Check this box: versions, GPUs, /dev/shm, RAM, memlock, Triton, disk, bandwidth, port, Ray, S3."""
    from appliance.plan.doctor import run_doctor
    from appliance.storage.hub import resolve_model

    model = resolve_model(model) if model else model  # a hub id: its local-cache snapshot
    sys.exit(run_doctor(model, preset, base_quant, device, metrics_port, as_json))
