"""The run's typed configuration: one schema for config-file keys and command-line flags.

Every field is a config-file key (`seq_len: 512`) and a flag (`--seq-len 512`); its docstring
(`help`) feeds `--help`. Values are merged in layers, then validated once:

    defaults ← demo settings (only when no --model is given anywhere) ← config file ← flags

Every problem is reported together, each naming where the value came from: the flag
(`--lr: 'x' is not a valid float`) or the config file and key (`--config run.yaml: lr: ...`).

    schema.py  TrainConfig: the fields, their defaults, help, choices and groups
    build.py   build_config (merge, coerce, validate), read_config_file
"""

from appliance.config.build import (
    KEY_ALIASES,
    base_type,
    build_config,
    flag,
    optional,
    parse_bytes,
    read_config_file,
    shown,
    validate,
)
from appliance.config.schema import (
    AUTO,
    CHECKPOINT_MINUTES,
    CHOICES,
    DEFAULT_METRICS_PORT,
    DEMO_SETTINGS,
    FIELDS,
    HELP_GROUPS,
    RUN_LENGTH,
    TrainConfig,
)

__all__ = [
    "AUTO",
    "KEY_ALIASES",
    "CHECKPOINT_MINUTES",
    "CHOICES",
    "DEFAULT_METRICS_PORT",
    "DEMO_SETTINGS",
    "FIELDS",
    "HELP_GROUPS",
    "RUN_LENGTH",
    "TrainConfig",
    "base_type",
    "build_config",
    "flag",
    "optional",
    "parse_bytes",
    "read_config_file",
    "shown",
    "validate",
]
