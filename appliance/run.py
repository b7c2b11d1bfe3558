"""One training run on Ray: the actors, the step loop, checkpoints and recovery.

`driver.py` checks the inputs and starts (or joins) Ray; a `Run` then owns the actors:

    WeightStore   one per node, the base model in shared memory (survives trainer restarts)
    ShardWorker   N tokenizer workers, each packing a disjoint shard into micro-batches
    Trainer       the streamed engine + LoRA + optimizer

and drives them: a bounded window of batch requests in flight, one `trainer.step` per optimizer
step, checkpoints every --checkpoint-every steps, and recovery from a dead trainer or worker.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import storage
from .checkpoint import json_bytes, load_latest_checkpoint, save_checkpoint
from .config import TrainConfig
from .engine import lr_at
from .errors import ApplianceError, ConfigError, cause_chain
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .metrics import DriverMetrics
from .progress import Progress
from .tokenize_worker import ACTOR_OPTIONS, ShardWorker, default_num_workers
from .trainer import Trainer, TrainerSettings
from .weight_store import WeightStore

RUN_FILE = "run.json"
TRAINER_STATE = "trainer_state.pt"  # LoRA weights + optimizer + step + RNG (torch.save)
DRIVER_STATE = "driver_state.json"  # step, schedule position, worker cursors, losses
CONFIG_FILE = "config.json"  # the run's resolved config
FAULT_ENV = "APPLIANCE_FAULT_KILL_DURING_CHECKPOINT"  # tests: SIGKILL mid-write at this step


class RestartsExhausted(ApplianceError):
    """More actor failures than --max-restarts allows."""


@contextlib.contextmanager
def _fault_injection(step: int):
    """If $APPLIANCE_FAULT_KILL_DURING_CHECKPOINT names this step, die by SIGKILL after the
    checkpoint's first file is written: how the tests prove a torn write loses nothing."""
    if os.environ.get(FAULT_ENV) != str(step):
        yield
        return
    real_write = storage.write_bytes

    def write_then_die(uri: str, data: bytes) -> None:
        real_write(uri, data)
        os.kill(os.getpid(), signal.SIGKILL)

    storage.write_bytes = write_then_die
    try:
        yield
    finally:
        storage.write_bytes = real_write


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
)


@dataclass
class Inputs:
    """Everything checked and resolved before the actors start (on the trainer's node with
    --cluster, so the paths are that node's)."""

    cfg: TrainConfig
    model_dir: Path
    data_path: Path
    tokenizer: Path
    eos_id: int
    pad_id: int | None
    device: str
    dtype: str
    eval_data: Path | None = None


@dataclass
class RunState:
    """Where the run is: enough to resume it exactly."""

    step: int = 0
    consumed: int = 0  # micro-batches consumed so far (position in the worker schedule)
    cursors: dict[int, dict] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    target_tokens: int = 0  # tokens trained on (labels != -100)
    skipped: dict[int, int] = field(default_factory=dict)  # bad records skipped, per worker
    tokenizer_pids: set[int] = field(default_factory=set)  # processes that tokenized

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "consumed": self.consumed,
            "cursors": {str(w): c for w, c in self.cursors.items()},
            "losses": self.losses,
            "target_tokens": self.target_tokens,
            "skipped": {str(w): n for w, n in self.skipped.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> RunState:
        return cls(
            step=d["step"],
            consumed=d["consumed"],
            cursors={int(w): c for w, c in d["cursors"].items()},
            losses=list(d["losses"]),
            target_tokens=d["target_tokens"],
            skipped={int(w): n for w, n in d["skipped"].items()},
        )


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


def write_adapter(output: str, files: dict[str, bytes]) -> None:
    """Weights first, config last: a directory with adapter_config.json is a complete adapter."""
    config_uri = storage.join(output, ADAPTER_CONFIG)
    if storage.exists(config_uri):
        storage.delete(config_uri)  # an old config beside new weights would look complete
    storage.write_bytes(storage.join(output, ADAPTER_WEIGHTS), files[ADAPTER_WEIGHTS])
    storage.write_bytes(config_uri, files[ADAPTER_CONFIG])


def trainer_settings(inp: Inputs) -> TrainerSettings:
    cfg = inp.cfg
    return TrainerSettings(
        lora=cfg.lora_spec(),
        device=inp.device,
        dtype=inp.dtype,
        gpu_memory_budget=cfg.budget_bytes(),
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
        base_model=str(cfg.model),
    )


def worker_kwargs(
    inp: Inputs, index: int, num_workers: int, epochs: int | None, cursor: dict | None = None
) -> dict:
    cfg = inp.cfg
    return dict(
        data_path=cfg.data,  # a URI: each worker fetches it on its own node
        tokenizer_path=storage.join(cfg.model, "tokenizer.json"),
        worker_index=index,
        num_workers=num_workers,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        eos_id=inp.eos_id,
        pad_id=inp.pad_id,
        epochs=epochs,
        on_bad_record=cfg.on_bad_record,
        cursor=cursor,
    )


def count_batches(kwargs: dict) -> int:
    """Micro-batches one worker yields in one epoch (a tokenizing pre-pass, for --epochs)."""
    worker = ShardWorker(**{**kwargs, "epochs": 1, "cursor": None})
    n = 0
    while worker.next_batch() is not None:
        n += 1
    return n


def schedule(counts: list[int] | None, num_workers: int, total: int) -> list[int]:
    """Which worker supplies each of the run's `total` micro-batches: round-robin, skipping
    workers whose shard is used up (with --epochs, `counts` is batches per worker in all)."""
    if counts is None:
        return [g % num_workers for g in range(total)]
    left = list(counts)
    order: list[int] = []
    w = 0
    while len(order) < total and any(left):
        if left[w] > 0:
            order.append(w)
            left[w] -= 1
        w = (w + 1) % num_workers
    return order


# ---------------------------------------------------------------------- the run


class Run:
    """One training run on Ray (embedded, or a cluster given by --cluster)."""

    def __init__(self, inp: Inputs, progress: Progress, node_id: str | None = None):
        self.inp, self.cfg, self.progress = inp, inp.cfg, progress
        self.node_id = node_id  # the trainer's (and its weight store's) node with --cluster
        self.state = RunState()
        self.metrics = DriverMetrics()
        self.restarts = 0

    def create_actors(self) -> None:
        """The weight store, the data schedule, then (from the resumed state, if any) the
        tokenizer workers and the trainer."""
        import ray

        cfg, inp = self.cfg, self.inp
        cpus = int(ray.available_resources().get("CPU", os.cpu_count() or 1))
        self.num_workers = cfg.tokenize_workers or default_num_workers(cpus)
        if self.num_workers + 1 > cpus:  # an actor without a CPU would wait forever
            raise ConfigError(
                f"--tokenize-workers {self.num_workers} needs {self.num_workers + 1} "
                f"CPUs (one per worker + the trainer); Ray has {cpus}"
            )
        self.store = (
            ray.remote(num_cpus=0)(WeightStore)
            .options(**self._on_trainer_node())
            .remote(inp.cfg.model, inp.dtype)
        )
        self.handles = ray.get(self.store.handles.remote())
        self.epochs = None if cfg.steps else (cfg.epochs or 1)
        if self.epochs is None:
            self.counts = None
            self.total_steps = int(cfg.steps)
        else:
            count = ray.remote(**ACTOR_OPTIONS)(count_batches)
            per_epoch = ray.get(
                [
                    count.remote(worker_kwargs(inp, w, self.num_workers, 1))
                    for w in range(self.num_workers)
                ]
            )
            self.counts = [n * self.epochs for n in per_epoch]
            self.total_steps = math.ceil(sum(self.counts) / cfg.micro_batches_per_step)
        total_micro = self.total_steps * cfg.micro_batches_per_step
        self.order = schedule(self.counts, self.num_workers, total_micro)
        self.trainer = self._make_trainer()
        if cfg.resume:
            self.restore()
        self.workers = [self._make_worker(w) for w in range(self.num_workers)]

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        import ray

        t0 = time.perf_counter()
        files = dict(ray.get(self.trainer.adapter_files.remote()))
        files[TRAINER_STATE] = ray.get(self.trainer.state_bytes.remote())
        files[DRIVER_STATE] = json_bytes(self.state.to_json())
        files[CONFIG_FILE] = json_bytes(self.cfg.to_dict())
        with _fault_injection(self.state.step):
            save_checkpoint(self.cfg.output, self.state.step, files, self.cfg.keep_checkpoints)
        self.metrics.checkpoint_seconds(time.perf_counter() - t0)

    def restore(self) -> None:
        """Put the trainer and the run state back to the latest complete checkpoint (or to the
        start when there is none); the weight store is untouched."""
        import ray

        ckpt = load_latest_checkpoint(self.cfg.output)
        for problem in ckpt.skipped if ckpt else []:
            self.progress.note(f"warning: skipped a damaged checkpoint: {problem}")
        if ckpt is None:
            self.state = RunState()
            return
        self.state = RunState.from_json(json.loads(ckpt.files[DRIVER_STATE]))
        ray.get(self.trainer.load_state_bytes.remote(ckpt.files[TRAINER_STATE]))
        self.progress.note(f"resumed from {ckpt.name} (step {self.state.step})")

    # ------------------------------------------------------------ faults

    def recover(self, error: BaseException) -> None:
        """Recreate what died and rewind to a consistent point, or re-raise.

        A dead trainer is recreated over the same weight store and restored from the last
        checkpoint; dead tokenizer workers are recreated from the cursors of the last batches
        the trainer consumed. User errors (bad data) and bugs are not retried.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        chain = cause_chain(error)
        user = next((c for c in chain if isinstance(c, ApplianceError)), None)
        if user is not None:
            raise user
        if not any(isinstance(c, RayActorError) for c in chain):
            raise error
        trainer_died = isinstance(error, RayActorError) and not isinstance(error, RayTaskError)
        kind = "trainer" if trainer_died else "tokenizer"
        self.restarts += 1
        self.progress.restarts = self.restarts
        self.metrics.restart(kind)
        if self.restarts > self.cfg.max_restarts:
            raise RestartsExhausted(
                f"giving up after {self.cfg.max_restarts} restarts "
                f"(--max-restarts); last failure ({kind}): {chain[-1]}"
            )
        self.progress.note(
            f"{kind} failed ({type(chain[-1]).__name__}); restart "
            f"{self.restarts}/{self.cfg.max_restarts}"
        )
        if trainer_died:
            self.trainer = self._make_trainer()
            self.restore()
        for w in self.workers:  # queued requests are void: every worker restarts at its cursor
            ray.kill(w)
        self.workers = [self._make_worker(w) for w in range(self.num_workers)]

    def _make_worker(self, w: int):
        import ray

        kwargs = worker_kwargs(
            self.inp, w, self.num_workers, self.epochs, self.state.cursors.get(w)
        )
        return ray.remote(**ACTOR_OPTIONS)(ShardWorker).remote(**kwargs)

    def _make_trainer(self):
        import ray

        options: dict[str, Any] = {"num_cpus": 1}
        if self.inp.device == "cuda":
            options = {"num_gpus": 1, "num_cpus": 1}
        options.update(self._on_trainer_node())  # beside its weight store: shared memory
        return ray.remote(**options)(Trainer).remote(self.handles, trainer_settings(self.inp))

    def _on_trainer_node(self) -> dict:
        if self.node_id is None:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id, soft=False)}

    def train(self) -> RunState:
        """The step loop with a bounded window of batch requests in flight."""
        import ray

        cfg = self.cfg
        M = cfg.micro_batches_per_step
        window = cfg.prefetch * M  # micro-batches requested ahead of the trainer
        pending: deque = deque()
        requested = self.state.consumed
        self.progress.start(self.total_steps, self.state.step)
        while self.state.step < self.total_steps:
            st = self.state
            while requested < len(self.order) and requested - st.consumed < window + M:
                pending.append(self.workers[self.order[requested]].next_batch.remote())
                requested += 1
            refs = [pending.popleft() for _ in range(min(M, len(self.order) - st.consumed))]
            lr = lr_at(
                st.step,
                lr=cfg.lr,
                warmup_steps=cfg.warmup_steps,
                total_steps=self.total_steps,
                min_lr_ratio=cfg.min_lr_ratio,
            )
            try:
                stats = ray.get(self.trainer.step.remote(refs, lr))
            except Exception as e:  # noqa: BLE001 - recover() re-raises what it cannot handle
                self.recover(e)
                pending.clear()
                requested = self.state.consumed
                continue
            st.step += 1
            st.consumed += len(refs)
            st.cursors.update({int(w): c for w, c in stats["cursors"].items()})
            st.losses.append(stats["loss"])
            st.target_tokens += stats["target_tokens"]
            st.skipped.update({int(w): n for w, n in stats["skipped_records"].items()})
            st.tokenizer_pids.update(stats["pids"])
            stats["batches_in_flight"] = requested - st.consumed
            self.metrics.batches_in_flight(stats["batches_in_flight"])
            self.progress.step(st.step, stats)
            every = cfg.checkpoint_every
            if st.step == self.total_steps or (every and st.step % every == 0):
                self.save_checkpoint()
        return self.state

    def evaluate(self, path: Path) -> float:
        """Mean next-token loss over `path` (the demo's held-out corpus), via the trainer."""
        import ray

        worker = ShardWorker(**{**worker_kwargs(self.inp, 0, 1, 1), "data_path": str(path)})
        batches = []
        while (b := worker.next_batch()) is not None:
            batches.append(b)
        nll, n = ray.get(self.trainer.eval_loss.remote(batches))
        return nll / max(n, 1)

    def finish(self) -> None:
        import ray

        files = ray.get(self.trainer.adapter_files.remote())
        write_adapter(self.cfg.output, files)
        write_run_file(
            self.cfg,
            "complete",
            {
                "steps": self.state.step,
                "losses": self.state.losses,
                "restarts": self.restarts,
                "skipped_records": sum(self.state.skipped.values()),
            },
        )
