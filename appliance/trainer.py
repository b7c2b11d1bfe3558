"""Trainer: one per GPU (or one on the CPU). Owns the streamed engine, the LoRA adapter and its
optimizer; takes batches by object ref; returns what each step measured.

A plain class, used directly in tests and in-process runs, and as a Ray actor by the driver.
The base weights come from the node's WeightStore as zero-copy views; nothing here reloads them.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from .blocks import dtype_from_name
from .engine import StreamedEngine
from .gpu_monitor import NvmlSampler
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSpec, LoraWeights, adapter_config
from .metrics import TrainerMetrics, peak_flops_per_second
from .weight_store import WeightHandles


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
    base_model: str = ""


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype


class Trainer:
    def __init__(self, handles: WeightHandles, settings: TrainerSettings, rank: int = 0):
        self.settings = settings
        self.source = handles.source()  # zero-copy views of the store's buffers
        torch.manual_seed(settings.seed)
        device = torch.device(settings.device)
        self.lora = LoraWeights(self.source.args, settings.lora, device, seed=settings.seed)
        self.engine = StreamedEngine(
            self.source,
            self.lora,
            device=device,
            dtype=dtype_from_name(settings.dtype),
            gpu_memory_budget=settings.gpu_memory_budget,
            weight_decay=settings.weight_decay,
            grad_clip=settings.grad_clip or None,
            seed=settings.seed,
        )
        cuda = device.type == "cuda"
        peak = peak_flops_per_second(torch.cuda.get_device_name(device)) if cuda else None
        self.metrics = TrainerMetrics(rank=rank, peak_flops=peak)  # a no-op without Ray
        self.nvml = NvmlSampler.for_cuda_device(torch.cuda.current_device()) if cuda else None
        if self.nvml is not None:
            self.nvml.start()

    def step(self, batches: list[Any], lr: float) -> dict:
        """One optimizer step over `batches` (data.Batch objects or object refs to them)."""
        t0 = time.perf_counter()
        if self.nvml is not None:
            self.nvml.take_mean()  # drop the idle time between steps
        batches = _resolve(batches)
        data_wait = time.perf_counter() - t0
        micro = [
            (torch.from_numpy(np.array(b.input_ids)), torch.from_numpy(np.array(b.labels)))
            for b in batches
        ]
        stats = self.engine.train_step(micro, lr).as_dict()
        stats["phase_seconds"]["data_wait"] = data_wait
        stats["step_seconds"] += data_wait
        stats["lr"] = lr
        stats["step"] = self.engine.step_count
        stats["cursors"] = {b.worker: b.cursor for b in batches}
        stats["pids"] = sorted({b.pid for b in batches})
        stats["skipped_records"] = {b.worker: b.skipped_records for b in batches}
        if self.settings.device == "cuda":
            stats["gpu_mem_allocated"] = torch.cuda.memory_allocated()
            stats["gpu_mem_reserved"] = torch.cuda.memory_reserved()
        if self.nvml is not None:
            stats["nvml_util_mean"] = self.nvml.take_mean()
        self.metrics.record_step(stats)
        return stats

    def eval_loss(self, batches: list[Any]) -> tuple[float, int]:
        batches = _resolve(batches)
        micro = [
            (torch.from_numpy(np.array(b.input_ids)), torch.from_numpy(np.array(b.labels)))
            for b in batches
        ]
        return self.engine.eval_loss(micro)

    # ------------------------------------------------------------ state

    def adapter_files(self) -> dict[str, bytes]:
        """The PEFT adapter as file name → bytes (written by the driver to local disk or S3)."""
        return {
            ADAPTER_WEIGHTS: safetensors_bytes(self.lora.peft_state_dict(), {"format": "pt"}),
            ADAPTER_CONFIG: json.dumps(
                adapter_config(self.settings.lora, self.settings.base_model), indent=2
            ).encode(),
        }

    def state_bytes(self) -> bytes:
        """Optimizer state + step + LoRA weights, for checkpoints (torch.save)."""
        buf = io.BytesIO()
        torch.save(
            {
                "lora": self.lora.peft_state_dict(),
                "rng": torch.get_rng_state(),
                **self.engine.state_dict(),
            },
            buf,
        )
        return buf.getvalue()

    def load_state_bytes(self, data: bytes) -> int:
        state = torch.load(io.BytesIO(data), map_location=self.engine.device, weights_only=True)
        self.lora.load_peft_state_dict(state["lora"], "checkpoint")
        self.engine.load_state_dict(state)
        torch.set_rng_state(state["rng"])
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


def _resolve(batches: list[Any]) -> list[Any]:
    """Batches from object refs, fetched in order: when a tokenizer worker fails, its later
    batches fail too, and the error raised must be the first one (the real cause)."""
    import ray

    return [ray.get(b) if isinstance(b, ray.ObjectRef) else b for b in batches]
