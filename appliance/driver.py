"""The driver: `appliance train` from config to adapter.

    setup    check every input (model, tokenizer, data, output) before anything heavy starts;
             start Ray; create the WeightStore, the TokenizeWorkers and the Trainer
    train    keep a bounded window of batches in flight, step the trainer, schedule the LR,
             show progress, checkpoint
    cleanup  write the adapter (complete, then published), stop the actors

The driver holds no tensors: batches travel from the tokenizer workers to the trainer by object
ref, weights from the store to the trainer through shared memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import storage
from .checkpoint import json_bytes, load_latest_checkpoint, save_checkpoint
from .config import TrainConfig, flag
from .data import check_dataset
from .engine import lr_at
from .errors import ApplianceError, ConfigError
from .hf_checkpoint import read_model_args, tokenizer_path
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .metrics import DriverMetrics
from .progress import Progress
from .storage import StorageError
from .tokenize_worker import ACTOR_OPTIONS, TokenizeWorker, default_num_workers
from .trainer import Trainer, TrainerSettings, resolve_device, resolve_dtype
from .weight_store import WeightStore

RUN_FILE = "run.json"
TRAINER_STATE = "trainer_state.pt"  # LoRA weights + optimizer + step + RNG (torch.save)
DRIVER_STATE = "driver_state.json"  # step, schedule position, worker cursors, losses
CONFIG_FILE = "config.json"  # the run's resolved config
FAULT_ENV = "APPLIANCE_FAULT_KILL_DURING_CHECKPOINT"  # tests: SIGKILL mid-write at this step


class RestartsExhausted(ApplianceError):
    """More actor failures than --max-restarts allows."""


def _cause_chain(e: BaseException) -> list[BaseException]:
    """The exception and what it wraps (Ray nests an actor's failure in `.cause`)."""
    chain = [e]
    while isinstance(getattr(chain[-1], "cause", None), BaseException) and len(chain) < 10:
        chain.append(chain[-1].cause)  # type: ignore[attr-defined]
    return chain


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


# ---------------------------------------------------------------------- setup


def apply_demo(cfg: TrainConfig) -> Path | None:
    """With no --model, make the built-in demo (model, corpus, held-out corpus) in a temp dir and
    point `cfg` at it; returns the held-out corpus (None when not the demo)."""
    if cfg.model is not None:
        return None
    if cfg.cluster:
        raise ConfigError("--cluster needs --model, --data and --output (the demo runs locally)")
    from .demo import DEMO_SETTINGS, make_demo

    made = make_demo(tempfile.mkdtemp(prefix="appliance-demo-"), seed=cfg.seed)
    defaults = TrainConfig()
    for key, value in DEMO_SETTINGS.items():  # demo settings unless the user chose otherwise
        if getattr(cfg, key) == getattr(defaults, key):
            setattr(cfg, key, value)
    cfg.model, cfg.data = made["model"], made["data"]
    cfg.output = cfg.output or made["output"]
    return Path(made["eval_data"])


def prepare(cfg: TrainConfig) -> Inputs:
    """Resolve the demo, then check every input in this process (the embedded default)."""
    eval_data = apply_demo(cfg)
    inp = resolve_inputs(cfg)
    inp.eval_data = eval_data
    return inp


def _absolute(uri: str) -> str:
    return uri if storage.is_s3(uri) else str(Path(uri).expanduser().resolve())


def resolve_inputs(cfg: TrainConfig, where: str | None = None) -> Inputs:
    """Fetch (s3://) and check model, tokenizer, data and output, where this runs: in the driver
    for embedded Ray, on the trainer's node with --cluster (`where` names that node)."""
    assert cfg.model is not None and cfg.data is not None and cfg.output is not None
    cfg.model, cfg.data, cfg.output = (
        _absolute(cfg.model),
        _absolute(cfg.data),
        _absolute(cfg.output),
    )
    try:
        model_dir = storage.localize(cfg.model)
        data_path = storage.localize(cfg.data)
    except StorageError as e:
        if where is None or storage.is_s3(e.uri or ""):
            raise
        raise ConfigError(
            f"{e.uri} is not visible from the trainer's node {where}: with "
            "--cluster give s3:// URIs or paths shared by every node"
        ) from None
    args = read_model_args(model_dir)  # refuses unsupported architectures before any weight
    tok = tokenizer_path(model_dir)
    check_dataset(data_path, tok)  # errors here are clear; inside an actor they'd be wrapped
    problems = []
    if cfg.seq_len > args.max_position_embeddings:
        problems.append(
            f"{flag('seq_len')} {cfg.seq_len} exceeds the model's "
            f"max_position_embeddings ({args.max_position_embeddings})"
        )
    if args.sliding_window and cfg.seq_len > args.sliding_window:
        problems.append(
            f"{flag('seq_len')} {cfg.seq_len} exceeds the model's sliding_window "
            f"({args.sliding_window}); sliding-window attention is not implemented"
        )
    if args.eos_token_id is None:
        problems.append(f"{model_dir}/config.json has no eos_token_id: packing needs one")
    if problems:
        raise ConfigError("\n".join(problems))
    device = resolve_device(cfg.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible (use --device cpu or auto)")
    check_output(cfg)
    return Inputs(
        cfg,
        model_dir,
        data_path,
        tok,
        int(args.eos_token_id),
        args.pad_token_id,
        device,
        resolve_dtype(cfg.dtype, device),
    )


def run_identity(cfg: TrainConfig) -> dict:
    d = cfg.to_dict()
    return {k: d[k] for k in IDENTITY_KEYS}


def check_output(cfg: TrainConfig) -> None:
    """Refuse an --output that holds something else, unless --overwrite (or --resume of it)."""
    out = cfg.output
    run_file = storage.join(out, RUN_FILE)
    if storage.exists(run_file):
        previous = json.loads(storage.read_bytes(run_file))
        same = previous.get("identity") == run_identity(cfg)
        if cfg.resume:
            if not same:
                changed = [
                    k
                    for k in IDENTITY_KEYS
                    if previous.get("identity", {}).get(k) != run_identity(cfg)[k]
                ]
                raise ConfigError(
                    f"--resume: {out} holds a run with different "
                    f"{', '.join(flag(k) for k in changed)}; resuming would break it"
                )
            return
        if not cfg.overwrite:
            what = "the same run" if same else "a different run"
            raise ConfigError(
                f"--output {out} already holds {what} "
                f"({previous.get('status', 'unknown')}); pass --resume to continue "
                "it or --overwrite to replace it"
            )
        return
    if cfg.resume:
        raise ConfigError(f"--resume: {out} holds no run to resume ({RUN_FILE} not found)")
    if not cfg.overwrite and storage.list_files(out):
        raise ConfigError(
            f"--output {out} is not empty and holds no appliance run; choose an "
            "empty directory or pass --overwrite"
        )


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


class ShardWorker(TokenizeWorker):
    """A TokenizeWorker that first fetches its inputs (s3:// or a shared path) onto the node it
    runs on: tokenizer workers go wherever the cluster has CPUs."""

    def __init__(self, data_path: str, tokenizer_path: str, **kwargs: Any):
        super().__init__(
            str(storage.localize(data_path)), str(storage.localize(tokenizer_path)), **kwargs
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


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

        chain = _cause_chain(error)
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


def start_ray(cfg: TrainConfig, progress: Progress) -> None:
    """Embedded Ray (address="local", metrics on --metrics-port), or join --cluster."""
    import ray

    if ray.is_initialized():
        return
    from .metrics import metrics_url, ray_init_kwargs

    if cfg.cluster:
        address = cfg.cluster
        if address == "auto":
            address = os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(
                f"--cluster {address}: cannot connect to a Ray cluster: {e}"
            ) from None
        progress.note(f"connected to Ray cluster at {address}")
    else:
        ray.init(
            address="local",
            include_dashboard=False,
            log_to_driver=False,
            **ray_init_kwargs(cfg.metrics_port),
        )
        progress.note(f"metrics: {metrics_url(cfg.metrics_port)}")


TRAINER_NODE_RESOURCE = "appliance_trainer_node"  # marks nodes for trainers, beside "GPU"


def pick_trainer_node() -> tuple[str, str]:
    """(node id, address) of the node for the weight store and trainer: one that carries the
    appliance_trainer_node resource (set on GPU pods by the Helm chart), else any GPU node."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for key in (TRAINER_NODE_RESOURCE, "GPU"):
        for n in sorted(nodes, key=lambda n: n["NodeManagerAddress"]):
            if n["Resources"].get(key, 0) > 0:
                return n["NodeID"], n["NodeManagerAddress"]
    raise ConfigError(
        f"--cluster: no node has a GPU (or the {TRAINER_NODE_RESOURCE} resource); "
        "add a GPU worker group to the cluster"
    )


def connect(cfg: TrainConfig, progress: Progress) -> Run:
    """Start (or join, with --cluster) Ray and check the inputs where the trainer will run."""
    import ray

    eval_data = apply_demo(cfg)
    if not cfg.cluster:
        inp = resolve_inputs(cfg)
        inp.eval_data = eval_data
        start_ray(cfg, progress)
        return Run(inp, progress)
    start_ray(cfg, progress)
    node_id, address = pick_trainer_node()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    resolve = ray.remote(num_cpus=0)(resolve_inputs).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    try:
        inp = ray.get(resolve.remote(cfg, address))
    except Exception as e:
        raise _cause_chain(e)[-1] from None
    return Run(inp, progress, node_id)


def train(cfg: TrainConfig, progress: Progress | None = None) -> dict:
    """Run `appliance train` and return its summary."""
    import ray

    progress = progress or Progress(cfg.log_format)
    t0 = time.perf_counter()
    started_here = not ray.is_initialized()
    try:
        run = connect(cfg, progress)
        cfg = run.cfg
        write_run_file(cfg, "running")
        run.create_actors()
        eval_data = run.inp.eval_data
        before = run.evaluate(eval_data) if eval_data else None
        run.train()
        after = run.evaluate(eval_data) if eval_data else None
        run.finish()
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()  # also ends this job's actors on a cluster (Ctrl-C included)
    summary = {
        "steps": run.state.step,
        "final_loss": run.state.losses[-1] if run.state.losses else None,
        "output": cfg.output,
        "seconds": time.perf_counter() - t0,
        "target_tokens": run.state.target_tokens,
        "skipped_records": sum(run.state.skipped.values()),
    }
    if before is not None:
        summary.update(
            eval_loss_before=before, eval_loss_after=after, eval_loss_drop=1 - after / before
        )
    progress.finish(summary)
    return summary
