"""The processes of a run, as plain classes: Ray makes each an actor, and each also runs without
Ray (the tests and the bench use them directly).

    weight_store.py     WeightStore: the base model's blocks, loaded once per node into shared
                        memory (Ray's object store), quantized as they load
    tokenize_worker.py  TokenizeWorker / ShardWorker: data files → token rows, off the trainer
    trainer.py          Trainer: one per GPU; runs the streamed engine over the rows it is fed,
                        saves adapters and checkpoints
    full_trainer.py     FullTrainer: a Trainer that trains every weight (--finetuning-type full)
                        and writes the whole model in the Hugging Face layout
    full_files.py       its files: weight shards streamed from the host weights, the optimizer
                        a part a file
    weight_home.py      WeightHome: the writable /dev/shm file a full fine-tune's store owns
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.actors.tokenize_worker import ShardWorker, TokenizeWorker
    from appliance.actors.trainer import Trainer, TrainerSettings
    from appliance.actors.weight_store import WeightHandles, WeightStore

# Each name is loaded when first asked for (PEP 562), not here: a lazy import kept for start-up
# time. A tokenizer worker's process imports appliance.actors.tokenize_worker, and this file with
# it; importing the trainer here would load torch into every tokenizer worker, which uses none
# of it (1.0 s of CPU and 200 MB of memory each; tests/test_layers.py keeps it out).
_MODULE_OF = {
    "ShardWorker": "tokenize_worker",
    "TokenizeWorker": "tokenize_worker",
    "Trainer": "trainer",
    "TrainerSettings": "trainer",
    "WeightHandles": "weight_store",
    "WeightStore": "weight_store",
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = [
    "ShardWorker",
    "TokenizeWorker",
    "Trainer",
    "TrainerSettings",
    "WeightHandles",
    "WeightStore",
]
