"""Starting a run's actors: how many of each, where they go, and what each is given.

`Run.create_actors` (loop.py) calls these in order:

    actor_counts    trainers (one per GPU or trainer slot) and tokenizer workers (one per
                    spare CPU); a resumed run keeps its own counts
    start_stores    one WeightStore per trainer node; the base model loads once per node
    make_trainers   the trainer ranks, each beside its node's store, in one process group
    make_worker     one tokenizer worker, at its data cursor

The settings each trainer is built with (`trainer_settings`) come from the checked config.
"""

from __future__ import annotations

import os

from appliance.actors.tokenize_worker import ACTOR_OPTIONS, ShardWorker, default_num_workers
from appliance.actors.trainer import TrainerSettings, resolve_kernels
from appliance.actors.weight_store import WeightStore
from appliance.cluster.start import Slot, local_slots, on_node
from appliance.config import TrainConfig, flag
from appliance.errors import ConfigError
from appliance.run.failures import gather
from appliance.run.feed import worker_kwargs
from appliance.run.progress import Progress
from appliance.run.state import Inputs
from appliance.storage.hub import cached_repo


def trainer_settings(inp: Inputs, world_size: int = 1) -> TrainerSettings:
    cfg = inp.cfg
    base = cached_repo(str(cfg.model))  # a hub id's snapshot: the adapter names the id
    return TrainerSettings(
        lora=cfg.lora_spec(),
        device=inp.device,
        dtype=inp.dtype,
        gpu_memory_budget=cfg.budget_bytes(),
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
        base_model=base.repo_id if base else str(cfg.model),
        base_revision=base.revision if base else None,
        world_size=world_size,
        compile_blocks=cfg.compile_blocks,
        kernels=resolve_kernels(cfg.kernels, inp.device, cfg.compile_blocks),
        model=str(cfg.model),
        freeze_embeddings=cfg.freeze_embeddings,
    )


def actor_counts(
    inp: Inputs, slots_given: list[Slot] | None, before: dict
) -> tuple[int, list[Slot], int]:
    """(trainers R, the R slots they go to, tokenizer workers W). `slots_given`: --cluster's
    trainer slots (None: this machine's GPUs, or one CPU slot); `before`: a resumed run's
    driver state ({} for a new run), whose counts it keeps. Too few CPUs for R + W actors is
    refused here, naming the flag that fixes it (an actor without a CPU would wait forever)."""
    import ray

    cfg = inp.cfg
    R = _kept_on_resume(cfg, "trainers", before.get("trainers"), "it sets the global batch")
    slots = slots_given if slots_given is not None else local_slots(inp.device, R)
    R = R or len(slots)
    if not 0 < R <= len(slots):
        where = "trainer slots (GPUs of trainer nodes)" if slots_given is not None else "GPUs"
        asked = f"--trainers {R}" if cfg.trainers else "training"
        raise ConfigError(f"{asked}: Ray sees {len(slots)} {where}; each trainer needs one")
    ranks = slots[:R]
    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    W = _kept_on_resume(
        cfg,
        "tokenize_workers",
        before.get("tokenize_workers"),
        "its data cursors are per worker",
    )
    num_workers = W or default_num_workers(cpus - (R - 1), inp.documents)
    if num_workers + R > cpus:  # an actor without a CPU would wait forever
        if cfg.tokenize_workers and W > 1 and cpus > R:
            raise ConfigError(
                f"--tokenize-workers {W} needs {W + R} CPUs (one per worker and one per "
                f"trainer); Ray has {cpus}: pass a smaller --tokenize-workers"
            )
        if R > 1:  # the trainers take the CPUs: fewer of them is the fix
            asked = f"--trainers {R}" if cfg.trainers else f"{R} trainers (one per GPU)"
            raise ConfigError(
                f"{asked} and {num_workers} tokenizer worker(s) need "
                f"{R + num_workers} CPUs (one each); Ray has {cpus}: pass --trainers "
                f"{max(cpus - 1, 1)} or fewer, or run where Ray has more CPUs"
            )
        raise ConfigError(
            f"training needs at least {R + 1} CPUs (one per trainer and one tokenizer "
            f"worker); Ray has {cpus}: run on a machine or cluster with more CPUs"
        )

    return R, ranks, num_workers


def start_stores(inp: Inputs, ranks: list[Slot], progress: Progress) -> tuple[dict, dict]:
    """One WeightStore per trainer node (the base model loaded once per node) and the handles
    to its buffers, both keyed by node id; says how long the load took. A full fine-tune's
    stores also give the weights a writable home (actors/weight_home.py)."""
    import ray

    cfg = inp.cfg
    store = ray.remote(num_cpus=0)(WeightStore)
    nodes = list(dict.fromkeys(s.node_id for s in ranks))  # each trainer node once
    stores = {
        n: store.options(**on_node(n)).remote(
            cfg.model, inp.dtype, cfg.base_quant, writable=cfg.finetuning_type == "full"
        )
        for n in nodes
    }
    handles = ray.get([stores[n].handles.remote() for n in nodes])
    handles = dict(zip(nodes, handles, strict=True))
    loaded = ray.get(stores[nodes[0]].stats.remote())
    size, seconds = loaded["nbytes"], max(loaded["load_seconds"], 1e-9)
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    progress.note(
        f"base weights loaded: {shown} in {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s)"
    )
    return stores, handles


def make_trainers(trainer_class: type, inp: Inputs, ranks: list[Slot], handles: dict) -> list:
    """R trainer actors, each beside its node's weight store; with R > 1 one process group
    (rank 0 picks the address) that every rank joins before its engine is built."""
    import ray

    R, device = len(ranks), inp.device
    settings = trainer_settings(inp, R)
    gpus = {"num_gpus": 1} if device == "cuda" else {}
    actor = ray.remote(trainer_class)
    trainers = [
        actor.options(num_cpus=1, **gpus, **on_node(slot.node_id)).remote(
            handles[slot.node_id], settings, rank
        )
        for rank, slot in enumerate(ranks)
    ]
    if R > 1:
        address = ray.get(trainers[0].group_address.remote())
        gather([t.join_group.remote(address) for t in trainers])
    return trainers


def make_worker(inp: Inputs, w: int, num_workers: int, epochs: int | None, cursor=None):
    """Tokenizer worker w of num_workers, from its data cursor (None: the shard's start)."""
    import ray

    kwargs = worker_kwargs(inp, w, num_workers, epochs, cursor)
    return ray.remote(**ACTOR_OPTIONS)(ShardWorker).remote(**kwargs)


def _kept_on_resume(cfg: TrainConfig, name: str, before: int | None, why: str) -> int | None:
    """The count `name` a run resumed from a checkpoint keeps (`why`: what depends on it); a
    different explicit flag is refused. Without a checkpoint, the flag's value (None: default)."""
    given = getattr(cfg, name)
    if before is None:
        return given
    if given is not None and given != before:
        raise ConfigError(
            f"--resume: {cfg.output} was trained with {flag(name)} {before} ({why}); "
            f"pass {flag(name)} {before} or leave it out"
        )
    return before
