"""Trainer: one per GPU (or one on the CPU). Owns the streamed engine, the LoRA adapter and its
optimizer; takes batches by object ref; returns what each step measured.

A plain class, used directly in tests and in-process runs, and as a Ray actor by the driver.
The base weights come from the node's WeightStore as zero-copy views; nothing here reloads them.

Rank 0 writes the run's checkpoints and its final adapter to --output itself, and reads the
checkpoint it resumes from: the adapter and its AdamW state (about 12 GiB for 70B at rank 64)
never pass through the driver, which on a cluster runs on a small head node.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes

from appliance.actors.weight_store import WeightHandles
from appliance.engine.blocks import dtype_from_name
from appliance.engine.device_weights import with_index
from appliance.engine.memory import gpu_memory_cap
from appliance.engine.step import StreamedEngine
from appliance.errors import first_line
from appliance.hardware.gpu_monitor import NvmlSampler
from appliance.hardware.gpus import peak_flops_per_second
from appliance.metrics.recorders import TrainerMetrics
from appliance.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraSpec,
    LoraWeights,
    adapter_config,
)
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    CheckpointError,
    fault_injection,
    load_latest_checkpoint,
    save_checkpoint,
)

TRAINER_STATE = "trainer_state.pt"  # a checkpoint's LoRA weights + optimizer + step + RNG
BIG_FILES = (TRAINER_STATE, ADAPTER_WEIGHTS)  # what only rank 0 reads and writes


def write_adapter(output: str, files: dict[str, bytes]) -> None:
    """Weights first, config last: a directory with adapter_config.json is a complete adapter."""
    config_uri = storage.join(output, ADAPTER_CONFIG)
    if storage.exists(config_uri):
        storage.delete(config_uri)  # an old config beside new weights would look complete
    storage.write_bytes(storage.join(output, ADAPTER_WEIGHTS), files[ADAPTER_WEIGHTS])
    storage.write_bytes(config_uri, files[ADAPTER_CONFIG])


class UntrustedState(CheckpointError):
    """A checkpoint's trainer_state.pt that matches its manifest but is not a trainer state
    (tampered with, or another tool's): not loaded; the previous checkpoint is tried."""


@dataclass(frozen=True)
class TrainerSettings:
    """The subset of the run's config a trainer needs (picklable, small)."""

    lora: LoraSpec
    device: str = "cpu"
    dtype: str = "float32"
    gpu_memory_budget: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    base_model: str = ""  # adapter_config.json's base_model_name_or_path, and its revision
    base_revision: str | None = None
    world_size: int = 1  # data-parallel trainers; > 1: call join_group before the first step
    compile_blocks: bool = False  # torch.compile the blocks (StreamedEngine)
    kernels: str = "exact"  # the tier of block kernels, resolved (resolve_kernels)
    # full fine-tuning (actors/full_trainer.py): --model as given, and --freeze-embeddings
    model: str = ""
    freeze_embeddings: bool = False


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype `dtype` names on `device` (already resolved: cpu | cuda). `auto` is
    bfloat16 on a GPU that computes it natively (Ampere and newer), float16 with loss scaling on
    an older one (engine/step.py), float32 on the CPU. The one place that decides: train, eval, bench
    and doctor all ask it."""
    if dtype != "auto":
        return dtype
    if device != "cuda":
        return "float32"
    # not counting emulation: bf16 emulated on a pre-Ampere card is several times slower
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


#: what `--kernels auto` picks on each device: the one switch for the default tier. The issue
#: asks CUDA for the fastest tier that passes its rule; until a GPU run has measured fast
#: faster than exact (docs/benchmarks.md), CUDA keeps exact too.
AUTO_KERNELS = {"cpu": "exact", "cuda": "exact"}


def resolve_kernels(kernels: str, device: str, compile_blocks: bool = False) -> str:
    """The tier of block kernels that runs: `kernels` (auto | exact | fast) on `device`
    (resolved: cpu | cuda); compiled blocks are fast-tier kernels whatever was asked. The one
    place that decides: the trainer's engine and the run record ask it."""
    if compile_blocks:
        return "fast"
    return AUTO_KERNELS.get(device, "exact") if kernels == "auto" else kernels


def backend_for(device: str) -> str:
    """The torch.distributed backend of data-parallel trainers on `device`."""
    return "nccl" if device == "cuda" else "gloo"


class Trainer:
    """Rank `rank` of `settings.world_size` data-parallel trainers (every rank starts from the
    same seed, so the same LoRA init; the engine's all-reduce keeps them equal)."""

    def __init__(self, handles: WeightHandles, settings: TrainerSettings, rank: int = 0):
        self.settings = settings
        self.rank = rank
        self.source = handles.source()  # zero-copy views of the store's buffers
        torch.manual_seed(settings.seed)
        device = torch.device(settings.device)
        self.device = device
        self.lora = LoraWeights(self.source.args, settings.lora, device, seed=settings.seed)
        # the GPU memory budget caps this process's allocator for as long as the trainer lives
        self._owned = contextlib.ExitStack()
        self._owned.enter_context(gpu_memory_cap(with_index(device), settings.gpu_memory_budget))
        # with several ranks the engine needs the process group: join_group makes it
        self.engine: StreamedEngine | None = None
        try:
            if settings.world_size == 1:
                self.engine = self._make_engine(None)
        except BaseException:
            self._owned.close()  # no trainer is left to close: the cap goes now
            raise
        cuda = device.type == "cuda"
        peak = peak_flops_per_second(torch.cuda.get_device_name(device)) if cuda else None
        self.metrics = TrainerMetrics(rank=rank, peak_flops=peak)  # a no-op without Ray
        self.nvml = NvmlSampler.for_cuda_device(torch.cuda.current_device()) if cuda else None
        if self.nvml is not None:
            self.nvml.start()

    def _make_engine(self, group: dist.ProcessGroup | None) -> StreamedEngine:
        return StreamedEngine(
            self.source, self.lora, kernels=self.settings.kernels, **self._engine_options(group)
        )

    def _engine_options(self, group: dist.ProcessGroup | None) -> dict:
        """The engine's settings from this rank's (FullTrainer adds its own to them)."""
        s = self.settings
        return dict(
            device=self.device,
            dtype=dtype_from_name(s.dtype),
            gpu_memory_budget=s.gpu_memory_budget,
            weight_decay=s.weight_decay,
            grad_clip=s.grad_clip or None,
            seed=s.seed,
            group=group,
            compile_blocks=s.compile_blocks,
        )

    def group_address(self) -> str:
        """Rank 0: a free TCP port on this node's IP, as the group's init_method."""
        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:  # freed again at once: the group's store binds it next
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def join_group(self, init_method: str) -> int:
        """Join the data-parallel group (every rank calls this at once: it blocks until all
        have), then build the engine over it. Returns this process's pid."""
        dist.init_process_group(
            backend_for(self.settings.device),
            init_method=init_method,
            rank=self.rank,
            world_size=self.settings.world_size,
            timeout=timedelta(minutes=10),
        )
        self.engine = self._make_engine(dist.group.WORLD)
        return os.getpid()

    def close(self) -> None:
        """Stop the NVML sampler, unpin the weights the engine page-locked and lift the memory
        cap (a plain-class trainer; an actor's process ends with ray.kill, which frees all)."""
        if self.nvml is not None:
            self.nvml.stop()
        if self.engine is not None:
            self.engine.close()
        self._owned.close()

    def step(self, batches: list[Any], lr: float, first: int = 0) -> dict:
        """One optimizer step over `batches` (records.Batch objects or object refs to them): this
        rank's share of the global batch, possibly none (the last step of an epoch), starting at
        index `first` of the global batch.

        Returns what the step measured; `loss`, `target_tokens` and `grad_norm` are the global
        batch's, `tokens` this rank's."""
        assert self.engine is not None, "join_group first: this trainer is one of several"
        t0 = time.perf_counter()
        if self.nvml is not None:
            self.nvml.take_mean()  # drop the idle time between steps
        batches = _resolve(batches)
        data_wait = time.perf_counter() - t0
        stats = self.engine.train_step(_tensors(batches), lr, first).as_dict()
        stats["phase_seconds"]["data_wait"] = data_wait
        stats["step_seconds"] += data_wait
        # GPU busy over the whole step, data wait included (CUDA-event seconds; None on CPU)
        busy = stats.pop("gpu_busy_seconds")
        stats["gpu_busy_ratio"] = None if busy is None else busy / stats["step_seconds"]
        stats["rank"] = self.rank
        stats["lr"] = lr
        stats["step"] = self.engine.step_count
        stats["cursors"] = {b.worker: b.cursor for b in batches}
        stats["pids"] = sorted({b.pid for b in batches})
        stats["skipped_records"] = {b.worker: b.skipped_records for b in batches}
        stats["cut_notes"] = [b.cut_note for b in batches if b.cut_note]
        if self.settings.device == "cuda":
            stats["gpu_mem_allocated"] = torch.cuda.memory_allocated()
            stats["gpu_mem_reserved"] = torch.cuda.memory_reserved()
        if self.nvml is not None:
            stats["nvml_util_mean"] = self.nvml.take_mean()
        stats["host_rss"] = _host_rss()
        self.metrics.record_step(stats)
        return stats

    def eval_loss(self, batches: list[Any]) -> tuple[float, int]:
        """(summed NLL, predicted tokens) of `batches` (no collective: any one rank can run it)."""
        assert self.engine is not None
        return self.engine.eval_loss(_tensors(_resolve(batches)))

    # ------------------------------------------------------------ state

    def save_checkpoint(self, output: str, step: int, files: dict[str, bytes], keep: int) -> str:
        """Rank 0: write the checkpoint of step `step` under `output` (checkpoint.save_checkpoint:
        complete, then published, then pruned to `keep`): this rank's adapter and trainer state,
        beside the driver's small `files` (its state, the run's config). Returns its URI."""
        files = {**self.adapter_files(), TRAINER_STATE: self.state_bytes(), **files}
        with fault_injection(step):
            return save_checkpoint(output, step, files, keep)

    def restore_latest_checkpoint(self, output: str) -> dict[str, Any] | None:
        """Rank 0: load the newest good checkpoint under `output` into this rank (damaged ones
        are skipped, as load_latest_checkpoint says). Returns None when there is none, else its
        name, the problems of those skipped, its small files (the driver's state, the config)
        and, in a one-item list (a reference, not resolved on the way), its trainer state put in
        the object store for the other ranks' load_state_bytes."""
        import ray

        untrusted: list[str] = []  # a trainer state that is not one: the previous checkpoint
        older_than = None
        while True:
            ckpt = load_latest_checkpoint(output, older_than=older_than)
            if ckpt is None and untrusted:
                raise CheckpointError(
                    f"no usable checkpoint under {output}: " + "; ".join(untrusted), untrusted
                )
            if ckpt is None:
                return None
            state = ckpt.files[TRAINER_STATE]
            try:
                self.load_state_bytes(state)
                break
            except UntrustedState as e:
                untrusted += [*ckpt.skipped, f"{storage.join(ckpt.uri, TRAINER_STATE)}: {e}"]
                older_than = ckpt.step
        shared = self.settings.world_size > 1  # one rank: nobody else to read it
        return self._restored(ckpt, untrusted, [ray.put(state)] if shared else [])

    def _restored(self, ckpt, untrusted: list[str], state: list) -> dict[str, Any]:
        """restore_latest_checkpoint's answer for `ckpt`: its name, the problems of the
        checkpoints skipped on the way to it (`untrusted`: a state that did not load; the
        loader's own), its small files, and `state` (what the other ranks load, in a one-item
        list; [] with one rank)."""
        return {
            "name": ckpt.name,
            "skipped": [*untrusted, *ckpt.skipped],
            "files": {name: data for name, data in ckpt.files.items() if not self._big(name)},
            "state": state,
        }

    def _big(self, name: str) -> bool:
        """A checkpoint file only rank 0 reads (never sent to the driver)."""
        return name in BIG_FILES

    def write_adapter(self, output: str) -> None:
        """Rank 0: publish the final PEFT adapter in `output` (write_adapter)."""
        write_adapter(output, self.adapter_files())

    def adapter_files(self) -> dict[str, bytes]:
        """The PEFT adapter as file name → bytes (what checkpoints and the final adapter hold)."""
        return {
            ADAPTER_WEIGHTS: safetensors_bytes(self.lora.peft_state_dict(), {"format": "pt"}),
            ADAPTER_CONFIG: json.dumps(
                adapter_config(
                    self.lora.spec,
                    self.lora.args,
                    self.settings.base_model,
                    self.settings.base_revision,
                ),
                indent=2,
            ).encode(),
        }

    def state_bytes(self) -> bytes:
        """Optimizer state + step + LoRA weights, for checkpoints (torch.save)."""
        assert self.engine is not None
        buf = io.BytesIO()
        rng = {"rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        torch.save({"lora": self.lora.peft_state_dict(), **rng, **self.engine.state_dict()}, buf)
        return buf.getvalue()

    def load_state_bytes(self, data: bytes) -> int:
        assert self.engine is not None
        # to the CPU: RNG states must be CPU byte tensors; load_state_dict moves the optimizer's
        # state to its parameters' device
        try:  # weights_only: tensors and numbers; anything else is not a state this wrote
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not {"lora", "rng"} <= state.keys():
                raise ValueError("it does not hold a trainer's state (lora, rng)")
        except Exception as e:  # noqa: BLE001 - whatever the file is, it is not trusted
            raise UntrustedState(
                f"not trusted, not loaded ({type(e).__name__}: {first_line(e)[:200]}): a "
                "checkpoint's trainer state holds tensors and numbers only"
            ) from None
        self.lora.load_peft_state_dict(state["lora"], "checkpoint")
        self.engine.load_state_dict(state)
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return self.engine.step_count

    def info(self) -> dict:
        """This process: pid, node, memory (rss, and uss = private, not shared), LoRA size."""
        import psutil
        import ray

        mem = psutil.Process().memory_full_info()
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "rss": mem.rss,
            "uss": mem.uss,
            "lora_parameters": self.lora.num_parameters(),
        }


def _host_rss() -> int:
    """This process's resident host memory, bytes (the run's history logs it per step)."""
    import psutil

    return psutil.Process().memory_info().rss


def _resolve(batches: list[Any]) -> list[Any]:
    """Batches from object refs, fetched in order: when a tokenizer worker fails, its later
    batches fail too, and the error raised must be the first one (the real cause)."""
    import ray

    return [ray.get(b) if isinstance(b, ray.ObjectRef) else b for b in batches]


def _tensors(batches: list[Any]) -> list[tuple]:
    """(input_ids, labels) tensors of each batch, plus (positions, segments) when it packs
    documents, copied out of the read-only object-store views (never written through: see Ray's
    zero-copy rule)."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a))

    out: list[tuple] = []
    for b in batches:
        mb: tuple = (t(b.input_ids), t(b.labels))
        if getattr(b, "positions", None) is not None:
            mb += ((t(b.positions), t(b.segments)),)
        out.append(mb)
    return out
