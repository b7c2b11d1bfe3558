"""The run's typed configuration: one schema for config-file keys and command-line flags.

Every field is a config-file key (`seq_len: 512`) and a flag (`--seq-len 512`); its docstring
(`help`) feeds `--help`. Values are merged in layers, then validated once:

    defaults ← demo settings (only when no --model is given anywhere) ← config file ← flags

Every problem is reported together, each naming where the value came from: the flag
(`--lr: 'x' is not a valid float`) or the config file and key (`--config run.yaml: lr: ...`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from appliance.engine.memory import gpu_budget_problem
from appliance.errors import ConfigError
from appliance.metrics.endpoint import is_tcp_port
from appliance.models import TARGETS
from appliance.models.layers import TARGET_MODULES

CHECKPOINT_MINUTES = 10  # the default checkpoint interval, in minutes of training
DEFAULT_METRICS_PORT = 8080  # where Prometheus (compose) and KubeRay look for it


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # ---- what to train
    model: str | None = _f(
        None,
        "Base model: a Hugging Face directory or s3:// prefix (config.json, "
        "*.safetensors, tokenizer.json), or an id (org/name) in the local Hugging Face cache. "
        "Omit for the built-in demo.",
    )
    data: str | None = _f(
        None,
        "Training data: a .jsonl, .json, .parquet, .arrow or .txt file (.jsonl/.json/.txt may "
        "be .gz, .bz2, .xz or .zst compressed), a directory of them, a glob pattern "
        "('data/train-*.jsonl', '**' for any directories; quote it), s3:// (a pattern too), or "
        "a dataset id (org/name, or org/name/data/train-* for one split) in the local Hugging "
        "Face cache.",
    )
    output: str | None = _f(
        None, "Where the adapter and checkpoints go (directory or s3:// prefix)."
    )
    # ---- how long
    steps: int | None = _f(
        None, "Optimizer steps to run (default: 1 epoch when --epochs is unset)."
    )
    epochs: int | None = _f(None, "Passes over the data (alternative to --steps).")
    # ---- shapes
    seq_len: int = _f(256, "Tokens per training row.")
    micro_batch_size: int = _f(4, "Rows per micro-batch (one forward through a block).")
    micro_batches_per_step: int | str = _f(
        4,
        "Micro-batches per optimizer step; each block's weights are "
        "transferred once per pass for all of them. auto: on a GPU, measure host→device "
        "bandwidth and matmul rate at start and take the smallest M within 10% of "
        "compute-bound that fits (appliance plan's rule); 4 on a CPU.",
    )
    # ---- optimisation
    lr: float = _f(2e-4, "Peak learning rate (AdamW).")
    warmup_steps: int = _f(10, "Linear warm-up steps before the cosine decay.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of --lr.")
    weight_decay: float = _f(0.0, "AdamW weight decay on the LoRA parameters.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = _f(0, "Seed for LoRA init, dropout and data order.")
    # ---- LoRA
    lora_rank: int = _f(16, "LoRA rank r.")
    lora_alpha: float = _f(32.0, "LoRA alpha (scale = alpha / rank).")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input.")
    lora_targets: tuple[str, ...] = _f(
        tuple(TARGET_MODULES),
        "Modules to adapt, comma-separated: " + ",".join(TARGET_MODULES) + " (Phi-3's fused "
        "modules: qkv, gate_up, which q,k,v and gate,up also name).",
    )
    # ---- hardware
    device: str = _f("auto", "auto | cpu | cuda.")
    dtype: str = _f(
        "auto",
        "Compute dtype: auto (bfloat16 on GPU, float16 with loss scaling on a GPU without bf16, "
        "float32 on CPU) | float32 | bfloat16 | float16.",
    )
    gpu_memory_budget: str | None = _f(
        None, "Cap the appliance's GPU memory, e.g. 24GiB; blocks beyond it are streamed."
    )
    base_quant: str = _f(
        "none",
        "Store the base model's linear weights quantized (QLoRA): none | int8 (per row) | nf4 "
        "(4-bit NormalFloat, blocks of 64); a half or a quarter of the host memory and transfers.",
    )
    compile_blocks: bool = _f(
        False,
        "Run the transformer blocks through torch.compile: fused kernels, fewer launches (the "
        "first step compiles them). Off: the eager blocks, bitwise equal to transformers + PEFT.",
    )
    trainers: int | None = _f(
        None,
        "Trainers, one per GPU, training one adapter data-parallel; each takes "
        "--micro-batches-per-step micro-batches per step (default: every GPU Ray sees, 1 on CPU; "
        "with --cluster, every GPU of the trainer nodes, one per trainer node without GPUs).",
    )
    # ---- data pipeline
    tokenize_workers: int | None = _f(
        None, "Tokenizer worker actors (default: the CPUs beside the trainer, at most 4)."
    )
    prefetch: int = _f(2, "Optimizer steps' worth of batches kept in flight ahead of the trainer.")
    on_bad_record: str = _f("fail", "fail | skip: what to do with a malformed data record.")
    packing: str = _f(
        "documents",
        "documents (rows hold whole documents; a token attends only to its own document and "
        "positions restart at each) | stream (documents run together, attending across).",
    )
    chat_template: str | None = _f(
        None,
        "Jinja chat template file for conversation records (messages / ShareGPT), instead of "
        "the model's (tokenizer_config.json chat_template, or chat_template.jinja).",
    )
    # ---- validation during training
    eval_data: str | None = _f(
        None, "Held-out data (any --data format) scored during training and at the end."
    )
    eval_split: float | None = _f(
        None,
        "Hold out this fraction of --data's documents for validation (chosen by --seed, never "
        "trained on).",
    )
    eval_every: int | None = _f(
        None, "Validate every N steps on --eval-data / --eval-split (default: only at the end)."
    )
    # ---- output, checkpoints, faults
    checkpoint_every: int | None = _f(
        None,
        "Checkpoint every N steps (default: time-based, the first step boundary after each "
        f"{CHECKPOINT_MINUTES} minutes of training); always at the end and on Ctrl-C/SIGTERM.",
    )
    keep_checkpoints: int = _f(3, "Checkpoints to keep.")
    resume: bool = _f(False, "Continue the run in --output from its latest checkpoint.")
    auto_resume: bool = _f(
        False,
        "Continue the run in --output if it holds one (as --resume), else start it there: one "
        "command for the first run and every rerun (Kubernetes, docker --restart).",
    )
    overwrite: bool = _f(
        False,
        "Replace the appliance run in --output: removes only what appliance wrote there (where "
        "its run.json or checkpoint manifests show it): adapter_config.json, "
        "adapter_model.safetensors, checkpoints/step-N and checkpoints/latest, its own README.md "
        "card, run.json. Never touches other files (another tool's checkpoints, notes, data); an "
        "--output with no appliance run is refused, nothing deleted.",
    )
    allow_data_change: bool = _f(
        False,
        "With --resume or --auto-resume: continue although --data's files changed since the run "
        "started (a file whose name sorts after the others' is read after them; other changes "
        "shift what the run reads next). Without it such a resume is refused, naming the files.",
    )
    allow_model_change: bool = _f(
        False,
        "With --resume or --auto-resume: continue although --model's files (config.json, "
        "tokenizer, weights) changed since the run started, or it is another model: the steps "
        "from here train on it as it is now. Without it such a resume is refused.",
    )
    max_restarts: int = _f(3, "Trainer/worker restarts allowed before the run fails.")
    # ---- running
    cluster: str | None = _f(
        None,
        "Run on an existing Ray cluster at this address (or 'auto' for "
        "RAY_ADDRESS) instead of embedded Ray.",
        cli=False,
    )
    log_format: str = _f(
        "auto",
        "auto (rich on a terminal, plain lines otherwise) | rich (live table) | "
        "json (one object per step) | plain (a line every 10 s or 10 steps).",
    )
    metrics_port: int | None = _f(
        None,
        f"Port of the Prometheus metrics endpoint (embedded Ray). Default {DEFAULT_METRICS_PORT}, "
        "or the next free port when that one is taken; a port given here must be free.",
    )
    metrics_host: str = _f(
        "127.0.0.1",
        "Where the metrics endpoint (embedded Ray) listens: 127.0.0.1, this machine only (its "
        "labels name --output paths and buckets), or 0.0.0.0, every interface (a container "
        "whose port is published, a Prometheus on another host).",
    )
    object_store_memory: str | None = _f(
        None,
        "Ray object store size for embedded Ray, e.g. 100GiB; it holds the base model's weights "
        "(default: what /dev/shm holds, less a margin).",
    )

    def lora_spec(self):
        from appliance.models.lora import LoraSpec

        return LoraSpec(
            self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets)
        )

    def budget_bytes(self) -> int | None:
        return parse_bytes(self.gpu_memory_budget) if self.gpu_memory_budget else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "base_quant": ("none", "int8", "nf4"),
    "on_bad_record": ("fail", "skip"),
    "packing": ("documents", "stream"),
    "log_format": ("auto", "rich", "json", "plain"),
    "metrics_host": ("127.0.0.1", "0.0.0.0"),
}

# `train --help` shows its flags in these groups, in this order; a flag not listed lands in
# "Other options". A new flag: add its field name to one group.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "Model and data": ("config", "model", "data", "output", "steps", "epochs", "seq_len"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
    "Optimisation": (
        "micro_batch_size",
        "micro_batches_per_step",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "seed",
    ),
    "Hardware": (
        "device",
        "dtype",
        "base_quant",
        "gpu_memory_budget",
        "object_store_memory",
        "trainers",
        "cluster",
    ),
    "Data pipeline": (
        "packing",
        "chat_template",
        "tokenize_workers",
        "prefetch",
        "on_bad_record",
    ),
    "Validation": ("eval_data", "eval_split", "eval_every"),
    "Checkpoints and faults": (
        "checkpoint_every",
        "keep_checkpoints",
        "resume",
        "auto_resume",
        "overwrite",
        "allow_data_change",
        "allow_model_change",
        "max_restarts",
    ),
    "Output": ("log_format", "metrics_port", "metrics_host"),
}

# The built-in demo's settings (no --model): small rows, enough steps for the adapter to learn the
# demo grammar. A layer between the defaults and the config file: anything the user sets wins.
DEMO_SETTINGS: dict[str, Any] = dict(
    steps=300,
    seq_len=64,
    micro_batch_size=4,
    micro_batches_per_step=2,
    lr=3e-3,
    warmup_steps=20,
    lora_rank=16,
    lora_alpha=32.0,
)
AUTO = "auto"  # --micro-batches-per-step auto (resolved by the driver at start)
RUN_LENGTH = ("steps", "epochs")  # one choice: setting either replaces the demo's steps


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def base_type(name: str) -> type:
    """int, float, str, bool or tuple for a field (Optional unwrapped)."""
    hint = typing.get_type_hints(TrainConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def optional(name: str) -> bool:
    """Whether a field admits None ("not set": its annotation is Optional, its default None)."""
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[name])


def _expected(name: str) -> str:
    """What a field takes, for messages: 'a number', 'one of fail | skip', ..."""
    if name == "micro_batches_per_step":
        return f"an integer or {AUTO}"
    if name in CHOICES:
        return "one of " + " | ".join(CHOICES[name])
    kind = base_type(name)
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        tuple: "a list (a,b or [a, b])",
    }.get(kind, "a string")


def shown(value: Any) -> str:
    """A value as a config file or flag spells it, for messages: 0.0002, true, q,k,v, auto."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """'24GiB' → 25769803776; '24GB' → 24e9; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size like 24GiB")
    n, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    if unit == "B":
        return int(n)
    base = 1024 if "I" in unit else 1000
    return int(n * base ** powers[unit[0]])


def _coerce(name: str, value: Any, errors: list[str], where: str) -> Any:
    """Convert a config-file or flag value to the field's type, recording an error naming
    `where` (the flag, or the file and key) if it can't."""
    if value is None:
        return None
    if name == "micro_batches_per_step" and str(value).strip().lower() == AUTO:
        return AUTO
    kind = base_type(name)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1", "false", "no", "0"):
                return str(value).lower() in ("true", "yes", "1")
            raise ValueError
        if "\0" in str(value):  # no path, URI or name holds one (os calls raise on it)
            errors.append(f"{where}: {value!r} holds a NUL byte: give it without one")
            return FIELDS[name].default
        if kind is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip() for i in items if str(i).strip())
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):  # nan passed every range check: it trained on nan
                errors.append(f"{where}: {value!r} is not a finite number")
                return FIELDS[name].default
            return number
        return str(value)
    except (TypeError, ValueError):
        errors.append(f"{where}: {value!r} is not a valid {kind.__name__}")
        return FIELDS[name].default


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        example = Path(__file__).parent / "configs" / path.name
        hint = (
            f" (the example of that name ships with the package: --config {example})"
            if example.is_file()
            else ""
        )
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"--config {path}: file not found{where}{hint}") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    return data


# what a resumed run does not take from its run.json: how this invocation runs, not the run
PER_INVOCATION = (
    "resume",
    "auto_resume",
    "overwrite",
    "allow_data_change",
    "allow_model_change",
    "cluster",
    "log_format",
    "metrics_port",
    "metrics_host",
)


def build_config(
    file_values: dict[str, Any] | None = None,
    flag_values: dict[str, Any] | None = None,
    source: str = "config file",
    run_values: dict[str, Any] | None = None,
    run_source: str = "run.json",
    notes: list[str] | None = None,
) -> TrainConfig:
    """Merge defaults ← demo settings (no model anywhere) ← run ← file ← flags, then validate;
    raise ConfigError listing every problem. `source` names the file in messages (`--config
    x.yaml`). `run_values`: the recorded config of the run `--output O --resume` continues
    (`run_source` names it); its per-invocation keys are left out. --steps and --epochs are one
    choice: the highest layer that sets either wins, and a line saying so goes to `notes`."""
    errors: list[str] = []
    from_run = {
        name: _coerce(name, value, errors, f"{run_source}: {name}")
        for name, value in (run_values or {}).items()
        if name in FIELDS and name not in PER_INVOCATION and value is not None
    }
    from_file: dict[str, Any] = {}
    file_key: dict[str, str] = {}  # field name -> the key as the file spells it
    nulls: list[str] = []  # keys the file gives null although they have a value
    for key, value in (file_values or {}).items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{source}: unknown key {key!r}{hint}")
            continue
        file_key[name] = str(key)
        # `key: null` (or a bare `key:`) is the key left out; for a key that has a value (not
        # Optional) it is an error, reported below with what leaving it out gives
        if value is None:
            if not optional(name):
                nulls.append(name)
            continue
        from_file[name] = _coerce(name, value, errors, f"{source}: {key}")
    from_flags = {
        name: _coerce(name, value, errors, flag(name))
        for name, value in (flag_values or {}).items()
        if value is not None  # an unset flag leaves the file's value
    }
    _one_run_length(
        [(from_flags, flag), (from_file, lambda n: f"{source}: {file_key[n]}"), (from_run, None)],
        notes,
    )
    chosen = {**from_run, **from_file, **from_flags}
    values: dict[str, Any] = {}
    if chosen.get("model") is None:  # the built-in demo
        values.update(DEMO_SETTINGS)
        if any(k in chosen for k in RUN_LENGTH):
            values.pop("steps")
    for name in nulls:
        if name in from_run:
            left_out = f"{run_source}'s value ({shown(from_run[name])})"
        else:
            left_out = f"the default ({shown(values.get(name, FIELDS[name].default))})"
        errors.append(
            f"{source}: {file_key[name]}: null is not a value; give {_expected(name)}, "
            f"or leave the key out for {left_out}"
        )
    values.update(chosen)

    def label(name: str) -> str:
        if name in from_flags:
            return flag(name)
        if name in from_file:
            return f"{source}: {file_key[name]}"
        if name in from_run:
            return f"{run_source}: {name}"
        return flag(name)

    cfg = TrainConfig(**values)
    errors += validate(cfg, label)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def _one_run_length(layers: list[tuple[dict, Callable | None]], notes: list[str] | None) -> None:
    """--steps and --epochs are one choice: the first layer (highest) that sets either decides;
    the other key set in a lower layer is dropped, with a note naming both (the recorded run's
    length, replaced by a flag, goes silently: that is what the flag is for)."""
    decided_key, decided = None, ""  # the highest layer's choice, e.g. "steps", "--steps 40"
    for layer, label in layers:
        given = [k for k in RUN_LENGTH if k in layer]
        if decided_key is None:
            if len(given) == 1:  # both in one layer is an error validate() reports
                decided_key = given[0]
                decided = f"{label(decided_key)} {layer[decided_key]}" if label else ""
            continue
        for k in given:
            if k != decided_key:
                if notes is not None and label is not None:
                    notes.append(
                        f"{decided} overrides {label(k)}: {layer[k]} "
                        "(--steps and --epochs are one choice)"
                    )
                del layer[k]


def validate(cfg: TrainConfig, label: Callable[[str], str] = flag) -> list[str]:
    """Every problem with `cfg`, each naming where its value came from: `label(field)` (the flag
    by default); empty when valid."""
    errs = []

    def at_least(name: str, minimum: float) -> None:
        v = getattr(cfg, name)
        if v is not None and v != AUTO and v < minimum:
            errs.append(f"{label(name)} must be ≥ {minimum} (got {v})")

    for name in (
        "seq_len",
        "micro_batch_size",
        "micro_batches_per_step",
        "lora_rank",
        "prefetch",
        "keep_checkpoints",
        "steps",
        "epochs",
        "checkpoint_every",
        "tokenize_workers",
        "trainers",
        "eval_every",
    ):
        at_least(name, 1)
    for name in ("warmup_steps", "max_restarts", "weight_decay", "grad_clip"):
        at_least(name, 0)
    if cfg.lr <= 0:
        errs.append(f"{label('lr')} must be > 0 (got {cfg.lr})")
    if cfg.lora_alpha <= 0:
        errs.append(f"{label('lora_alpha')} must be > 0 (got {cfg.lora_alpha})")
    if not 0 <= cfg.lora_dropout < 1:
        errs.append(f"{label('lora_dropout')} must be in [0, 1) (got {cfg.lora_dropout})")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errs.append(f"{label('min_lr_ratio')} must be in [0, 1] (got {cfg.min_lr_ratio})")
    bad = [t for t in cfg.lora_targets if t not in TARGETS]
    if bad or not cfg.lora_targets:
        errs.append(
            f"{label('lora_targets')}: {','.join(bad) or '(none)'} not among {','.join(TARGETS)}"
        )
    for name, options in CHOICES.items():
        if getattr(cfg, name) not in options:
            errs.append(
                f"{label(name)} must be one of {' | '.join(options)} (got {getattr(cfg, name)!r})"
            )
    if cfg.steps is not None and cfg.epochs is not None:
        errs.append(f"{label('steps')} and {label('epochs')} are exclusive: give one")
    if cfg.eval_split is not None and not 0 < cfg.eval_split < 1:
        errs.append(f"{label('eval_split')} must be in (0, 1) (got {cfg.eval_split})")
    if cfg.eval_split is not None and cfg.eval_data is not None:
        errs.append(f"{label('eval_data')} and {label('eval_split')} are exclusive: give one")
    if cfg.eval_every is not None and cfg.eval_data is None and cfg.eval_split is None:
        if cfg.model is not None:  # the demo brings its own held-out corpus
            errs.append(f"{label('eval_every')} needs --eval-data PATH or --eval-split FRACTION")
    if cfg.resume and cfg.overwrite:
        errs.append(f"{label('resume')} and {label('overwrite')} are exclusive: give one")
    for other in ("resume", "overwrite"):
        if cfg.auto_resume and getattr(cfg, other):
            errs.append(f"{label('auto_resume')} and {label(other)} are exclusive: give one")
    if cfg.resume and cfg.output is None:  # (not the demo's fresh temp dir)
        errs.append(f"{label('resume')} needs --output DIR: the output of the run to continue")
    if cfg.allow_data_change and not (cfg.resume or cfg.auto_resume):
        errs.append(f"{label('allow_data_change')} goes with --resume or --auto-resume")
    if cfg.allow_model_change and not (cfg.resume or cfg.auto_resume):
        errs.append(f"{label('allow_model_change')} goes with --resume or --auto-resume")
    if cfg.gpu_memory_budget is not None:
        try:
            budget = parse_bytes(cfg.gpu_memory_budget)
        except ValueError as e:
            errs.append(f"{label('gpu_memory_budget')}: {e}")
        else:  # 0, or `24` (bytes): the plan's rule, so train refuses what plan refuses
            if problem := gpu_budget_problem(cfg.gpu_memory_budget, budget):
                errs.append(problem.replace("--gpu-memory-budget", label("gpu_memory_budget"), 1))
    if cfg.object_store_memory is not None:
        try:
            parse_bytes(cfg.object_store_memory)
        except ValueError as e:
            errs.append(f"{label('object_store_memory')}: {e}")
    if cfg.metrics_port is not None and not is_tcp_port(cfg.metrics_port):
        errs.append(f"{label('metrics_port')} must be a TCP port (got {cfg.metrics_port})")
    if cfg.model is None:  # the built-in demo: it brings its own model and corpus
        if cfg.data is not None:
            errs.append(
                f"{label('data')} needs --model: without --model the built-in demo trains on "
                "its own corpus; give --model too (or drop --data to run the demo)"
            )
        if cfg.cluster:
            errs.append("--cluster needs --model, --data and --output (the demo runs locally)")
    else:
        if cfg.data is None:
            errs.append("--data is required with --model")
        if cfg.output is None:
            errs.append("--output is required with --model")
    return errs
