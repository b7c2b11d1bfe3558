"""What defines a run and the record of it in its output directory (run.json): the identity keys
a resumed run must keep, and the file `appliance train` writes as the run starts, stops and ends."""

from __future__ import annotations

import json

from . import storage
from .config import TrainConfig

RUN_FILE = "run.json"

# the keys that define a run: changing one makes an existing output a different run
IDENTITY_KEYS = (
    "model",
    "data",
    "seq_len",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "seed",
    "micro_batch_size",
    "micro_batches_per_step",
    "base_quant",
    "packing",
    "eval_split",
)
# what a run.json written before an identity key existed meant by its absence: such a run packed
# documents as one stream, had an unquantized base and no held-out split
LEGACY_IDENTITY = {"base_quant": "none", "packing": "stream", "eval_split": None}


def run_identity(cfg: TrainConfig) -> dict:
    d = cfg.to_dict()
    return {k: d[k] for k in IDENTITY_KEYS}


def write_run_file(cfg: TrainConfig, status: str, extra: dict | None = None) -> None:
    record = {
        "identity": run_identity(cfg),
        "config": cfg.to_dict(),
        "status": status,
        **(extra or {}),
    }
    storage.write_bytes(storage.join(cfg.output, RUN_FILE), json.dumps(record, indent=2).encode())
