"""Building a run's config: a config file and flags merged over the defaults (and the demo's
settings), each value coerced to its field's type, then validated once, every problem named by
the flag or the file and key it came from."""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from appliance.config.schema import (
    AUTO,
    CHOICES,
    DEMO_SETTINGS,
    FIELDS,
    RUN_LENGTH,
    WANDB_MODES,
    TrainConfig,
    pair_items,
    parse_bytes,
)
from appliance.engine.memory import gpu_budget_problem
from appliance.errors import ConfigError
from appliance.metrics.endpoint import is_tcp_port
from appliance.models import TARGETS
from appliance.models.layers import TARGET_MODULES
from appliance.tracking import backend_problems, parse_report_to

#: the names Hugging Face's TrainingArguments, TRL, PEFT and axolotl give some settings: a config
#: file may use them (a note says which key each is read as); a flag says the appliance's name
KEY_ALIASES = {
    "learning_rate": "lr",
    "gradient_accumulation_steps": "micro_batches_per_step",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",  # axolotl
    "per_device_train_batch_size": "micro_batch_size",
    "max_steps": "steps",
    "max_grad_norm": "grad_clip",
    "sequence_len": "seq_len",  # axolotl
    "max_seq_length": "seq_len",  # TRL
    "lora_r": "lora_rank",  # axolotl
    "lora_target_modules": "lora_targets",  # axolotl, PEFT's target_modules
    "target_modules": "lora_targets",  # PEFT
    "output_dir": "output",
    "base_model": "model",  # axolotl
}
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer of a block (not the LM head)


def lora_target_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """--lora-targets as the appliance names them: its own short names (q, gate, qkv), PEFT's
    module names (q_proj, self_attn.q_proj, gate_up_proj) or all-linear (the seven projections;
    Phi-3's fused ones by their parts), each once, in order. Unknown names are left for
    validate() to name."""
    by_module = {path.rsplit(".", 1)[-1]: short for short, path in TARGETS.items()}
    out: list[str] = []
    for name in names:
        if name.lower().replace("_", "-") == ALL_LINEAR:
            shorts = list(TARGET_MODULES)
        else:
            shorts = [by_module.get(name.rsplit(".", 1)[-1], name)]
        out += [s for s in shorts if s not in out]
    return tuple(out)


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
            if isinstance(value, dict):  # {role: from, content: value}, {user: [human, usr]}
                value = [
                    f"{k}={v}"
                    for k, vs in value.items()
                    for v in (vs if isinstance(vs, (list, tuple)) else [vs])
                ]
            items = [value] if isinstance(value, str) else list(value)
            items = [part for i in items for part in str(i).split(",")]  # a,b given repeatedly
            return tuple(i.strip() for i in items if i.strip())
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
        example = Path(__file__).parent.parent / "configs" / path.name  # appliance/configs/
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
    aliased: list[str] = []
    for key, value in (file_values or {}).items():
        name = str(key).replace("-", "_")
        if name in KEY_ALIASES:  # a Hugging Face / axolotl name for one of ours
            own = KEY_ALIASES[name]
            if own in file_key or any(str(k).replace("-", "_") == own for k in file_values or {}):
                errors.append(f"{source}: {key} and {own} are one setting: give one")
                continue
            aliased.append(f"{key} as {own}")
            name = own
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
    cfg.given = frozenset(values)  # set by a layer or the demo: not for a run to choose
    cfg.report_to = parse_report_to(cfg.report_to)  # `none`, case, repeats: backend names
    cfg.lora_targets = lora_target_names(cfg.lora_targets)  # PEFT's names: q_proj, all-linear
    if aliased and notes is not None:
        notes.append(f"{source}: read {', '.join(aliased)} (the appliance's names)")
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


def _mixture_problems(cfg: TrainConfig, label: Callable[[str], str]) -> list[str]:
    """--mix-data takes PATH=WEIGHT items, each weight a number > 0, and needs --data; so does
    --data-weight."""
    errs = []
    for item in cfg.mix_data:
        path, _, weight = item.rpartition("=")
        try:
            ok = bool(path.strip()) and float(weight) > 0 and math.isfinite(float(weight))
        except ValueError:
            ok = False
        if not ok:
            errs.append(
                f"{label('mix_data')}: {item} is not PATH=WEIGHT with a weight > 0 (e.g. "
                "chat.jsonl=0.5)"
            )
    if cfg.mix_data and cfg.data is None:
        errs.append(f"{label('mix_data')} needs --data (the first dataset of the mixture)")
    if not (cfg.data_weight > 0):
        errs.append(f"{label('data_weight')} must be > 0 (got {cfg.data_weight})")
    return errs


def _mapping_problems(cfg: TrainConfig, label: Callable[[str], str]) -> list[str]:
    """--message-property-mappings takes role=KEY and content=KEY; --roles ROLE=NAME with ROLE
    one of system, user, assistant, tool, each NAME once."""
    from appliance.data.chat import ROLES

    errs = []
    for key, value in pair_items(cfg.message_property_mappings):
        if key not in ("role", "content") or not value:
            errs.append(
                f"{label('message_property_mappings')}: {key}={value} is not role=KEY or "
                "content=KEY (e.g. role=from,content=value)"
            )
    seen: dict[str, str] = {}
    for role, name in pair_items(cfg.roles):
        if role not in ROLES or not name:
            errs.append(
                f"{label('roles')}: {role}={name} is not ROLE=NAME with ROLE one of "
                f"{', '.join(ROLES)} (e.g. user=human,assistant=bot)"
            )
        elif seen.setdefault(name, role) != role:
            errs.append(f"{label('roles')}: {name} is given to both {seen[name]} and {role}")
    return errs


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
    if cfg.warmup_ratio is not None and not 0 <= cfg.warmup_ratio <= 1:
        errs.append(f"{label('warmup_ratio')} must be in [0, 1] (got {cfg.warmup_ratio})")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errs.append(f"{label('min_lr_ratio')} must be in [0, 1] (got {cfg.min_lr_ratio})")
    bad = [t for t in cfg.lora_targets if t not in TARGETS]
    if bad or not cfg.lora_targets:
        errs.append(
            f"{label('lora_targets')}: {','.join(bad) or '(none)'} not among {','.join(TARGETS)}"
        )
    errs += _mapping_problems(cfg, label)
    errs += _mixture_problems(cfg, label)
    for name, options in CHOICES.items():
        if getattr(cfg, name) not in options:
            errs.append(
                f"{label(name)} must be one of {' | '.join(options)} (got {getattr(cfg, name)!r})"
            )
    errs += _full_finetune_problems(cfg, label)
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
    errs += backend_problems(tuple(cfg.report_to), label("report_to"))
    if cfg.wandb_mode is not None and cfg.wandb_mode not in WANDB_MODES:
        errs.append(
            f"{label('wandb_mode')} must be one of {' | '.join(WANDB_MODES)} (got {cfg.wandb_mode!r})"
        )
    if "tensorboard" in cfg.report_to and cfg.output and "://" in str(cfg.output):
        if not cfg.logging_dir:
            errs.append(
                f"{label('report_to')} tensorboard with an s3:// --output needs --logging-dir DIR "
                "(a local directory for its event files)"
            )
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


def _full_finetune_problems(cfg: TrainConfig, label: Callable[[str], str]) -> list[str]:
    """What --finetuning-type full cannot be combined with, one line each."""
    full = cfg.finetuning_type == "full"
    if cfg.freeze_embeddings and not full:
        return [f"{label('freeze_embeddings')} goes with --finetuning-type full"]
    if not full:
        return []
    errs = []
    if cfg.base_quant != "none":
        errs.append(
            f"{label('finetuning_type')} full trains every weight, and a quantized base "
            f"({label('base_quant')} {cfg.base_quant}) cannot be trained: use --base-quant "
            "none, or --finetuning-type lora for QLoRA"
        )
    if cfg.dtype == "float16":
        errs.append(
            f"{label('finetuning_type')} full has no float16 loss scaling for weight "
            f"gradients: use {label('dtype')} bfloat16 or float32"
        )
    return errs
