"""The `appliance` command: the group and `train`; it adds eval, generate, export
(adapter_commands.py) and bench, plan, doctor (machine_commands.py).

Flags of `train` are generated from config.TrainConfig, so the config file and the command line
share one typed schema. User errors print as `error: ...` lines and exit 1, without a traceback.

Each command imports the package that does its work inside its function (start-up time: `appliance
--help`, `plan` or `doctor` do not load the run's Ray side, the engine or the exporter). These are
the only imports of the package's own modules kept inside functions, with quant/reference.py's
kernels (a C extension that may not be built, Triton) and run.train (the same reason as here).
"""

from __future__ import annotations

import click

from appliance.cli.adapter_commands import eval_cmd, export, generate
from appliance.cli.common import GroupedHelp, friendly_errors
from appliance.cli.machine_commands import bench, doctor_cmd, plan_cmd
from appliance.config import (
    CHOICES,
    FIELDS,
    base_type,
    build_config,
    flag,
    read_config_file,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("appliance")
    except PackageNotFoundError:
        return "unknown"


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


# the other commands, by role (`appliance --help` lists them all, sorted by name)
for command in (eval_cmd, generate, export, bench, plan_cmd, doctor_cmd):
    main.add_command(command)
