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

from appliance.actors.tokenize_worker import ShardWorker, TokenizeWorker
from appliance.actors.trainer import Trainer, TrainerSettings
from appliance.actors.weight_store import WeightHandles, WeightStore

__all__ = [
    "ShardWorker",
    "TokenizeWorker",
    "Trainer",
    "TrainerSettings",
    "WeightHandles",
    "WeightStore",
]
