"""The run's typed configuration: one schema for config-file keys and command-line flags.

Every field is a config-file key (`seq_len: 512`) and a flag (`--seq-len 512`); its docstring
(`help`) feeds `--help`. Values are merged defaults ← config file ← flags, then validated at once:
every problem is reported together, each naming the flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .model import TARGET_MODULES


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # ---- what to train
    model: str | None = _f(
        None,
        "Base model: a Hugging Face directory or s3:// prefix (config.json, "
        "*.safetensors, tokenizer.json). Omit for the built-in demo.",
    )
    data: str | None = _f(None, "Training data: a .jsonl/.txt file, a directory of them, or s3://.")
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
    micro_batches_per_step: int = _f(
        4,
        "Micro-batches per optimizer step; each block's weights are "
        "transferred once per pass for all of them.",
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
        "Modules to adapt, comma-separated: " + ",".join(TARGET_MODULES) + ".",
    )
    # ---- hardware
    device: str = _f("auto", "auto | cpu | cuda.")
    dtype: str = _f(
        "auto",
        "Compute dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16.",
    )
    gpu_memory_budget: str | None = _f(
        None, "Cap the appliance's GPU memory, e.g. 24GiB; blocks beyond it are streamed."
    )
    trainers: int | None = _f(
        None,
        "Trainers, one per GPU, training one adapter data-parallel; each takes "
        "--micro-batches-per-step micro-batches per step (default: every GPU Ray sees, 1 on CPU).",
    )
    # ---- data pipeline
    tokenize_workers: int | None = _f(
        None, "Tokenizer worker actors (default: the CPUs beside the trainer)."
    )
    prefetch: int = _f(2, "Optimizer steps' worth of batches kept in flight ahead of the trainer.")
    on_bad_record: str = _f("fail", "fail | skip: what to do with a malformed data record.")
    # ---- output, checkpoints, faults
    checkpoint_every: int | None = _f(None, "Checkpoint every N steps (and always at the end).")
    keep_checkpoints: int = _f(3, "Checkpoints to keep.")
    resume: bool = _f(False, "Continue the run in --output from its latest checkpoint.")
    overwrite: bool = _f(False, "Replace an --output that holds a different run.")
    max_restarts: int = _f(3, "Trainer/worker restarts allowed before the run fails.")
    # ---- running
    cluster: str | None = _f(
        None,
        "Run on an existing Ray cluster at this address (or 'auto' for "
        "RAY_ADDRESS) instead of embedded Ray.",
        cli=False,
    )
    log_format: str = _f("rich", "rich (live progress) | json (one object per step) | plain.")
    metrics_port: int = _f(8080, "Port of the Prometheus metrics endpoint (embedded Ray).")

    def lora_spec(self):
        from .lora import LoraSpec

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
    "on_bad_record": ("fail", "skip"),
    "log_format": ("rich", "json", "plain"),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def base_type(name: str) -> type:
    """int, float, str, bool or tuple for a field (Optional unwrapped)."""
    hint = typing.get_type_hints(TrainConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


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


def _coerce(name: str, value: Any, errors: list[str]) -> Any:
    """Convert a config-file or flag value to the field's type, recording an error if it can't."""
    if value is None:
        return None
    kind = base_type(name)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1", "false", "no", "0"):
                return str(value).lower() in ("true", "yes", "1")
            raise ValueError
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
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        errors.append(f"{flag(name)}: {value!r} is not a valid {kind.__name__}")
        return FIELDS[name].default


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    return data


def build_config(
    file_values: dict[str, Any] | None = None,
    flag_values: dict[str, Any] | None = None,
    source: str = "config file",
) -> TrainConfig:
    """Merge defaults ← file ← flags, then validate; raise ConfigError listing every problem."""
    errors: list[str] = []
    values: dict[str, Any] = {}
    for key, value in (file_values or {}).items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{source}: unknown key {key!r}{hint}")
            continue
        values[name] = _coerce(name, value, errors)
    for name, value in (flag_values or {}).items():
        if value is not None:
            values[name] = _coerce(name, value, errors)
    cfg = TrainConfig(**values)
    errors += validate(cfg)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def validate(cfg: TrainConfig) -> list[str]:
    """Every problem with `cfg`, each naming its flag (empty when valid)."""
    errs = []

    def positive(name: str, minimum: float = 1) -> None:
        v = getattr(cfg, name)
        if v is not None and v < minimum:
            errs.append(f"{flag(name)} must be ≥ {minimum} (got {v})")

    for name in (
        "seq_len",
        "micro_batch_size",
        "micro_batches_per_step",
        "lora_rank",
        "prefetch",
        "keep_checkpoints",
    ):
        positive(name)
    for name in ("steps", "epochs", "checkpoint_every", "tokenize_workers", "trainers"):
        positive(name)
    for name in ("warmup_steps", "max_restarts", "weight_decay", "grad_clip"):
        positive(name, 0)
    if cfg.lr <= 0:
        errs.append(f"--lr must be > 0 (got {cfg.lr})")
    if cfg.lora_alpha <= 0:
        errs.append(f"--lora-alpha must be > 0 (got {cfg.lora_alpha})")
    if not 0 <= cfg.lora_dropout < 1:
        errs.append(f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errs.append(f"--min-lr-ratio must be in [0, 1] (got {cfg.min_lr_ratio})")
    bad = [t for t in cfg.lora_targets if t not in TARGET_MODULES]
    if bad or not cfg.lora_targets:
        errs.append(
            f"--lora-targets: {','.join(bad) or '(none)'} not among {','.join(TARGET_MODULES)}"
        )
    for name, options in CHOICES.items():
        if getattr(cfg, name) not in options:
            errs.append(
                f"{flag(name)} must be one of {' | '.join(options)} (got {getattr(cfg, name)!r})"
            )
    if cfg.steps is not None and cfg.epochs is not None:
        errs.append("--steps and --epochs are exclusive: give one")
    if cfg.gpu_memory_budget is not None:
        try:
            parse_bytes(cfg.gpu_memory_budget)
        except ValueError as e:
            errs.append(f"--gpu-memory-budget: {e}")
    if not 0 < cfg.metrics_port < 65536:
        errs.append(f"--metrics-port must be a TCP port (got {cfg.metrics_port})")
    if cfg.model is not None and cfg.data is None:
        errs.append("--data is required with --model")
    if cfg.model is not None and cfg.output is None:
        errs.append("--output is required with --model")
    return errs
