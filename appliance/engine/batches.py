"""A step's inputs and outputs: the micro-batches it takes (MicroBatch: ids, labels, packing),
their target-token count and the sizes a memory plan is made for, and StepStats, what one
optimizer step measured. Shared by the LoRA engine (step.py) and the full fine-tune (full.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from appliance.models import layers

#: What a plan is sized for, of a batch (batch_sizes)
SIZES = ("tokens", "biggest", "longest")


class MicroBatch(NamedTuple):
    """One micro-batch. The engine's entries take plain tuples in this order too (as the data
    pipeline and the tests make them) and name their parts with `micro_batches`."""

    ids: torch.Tensor  # input token ids (B, T)
    labels: torch.Tensor  # the next tokens (B, T), IGNORE_INDEX where a position has no loss
    # packed documents: (positions (B, T), segments (B, T)): per-row RoPE positions and document
    # ids, so RoPE and attention restart at each document (models/layers.py); None for plain rows
    packing: tuple[torch.Tensor, torch.Tensor] | None = None


def micro_batches_of(batches: Sequence[Sequence[torch.Tensor | None]]) -> list[MicroBatch]:
    """`batches` as MicroBatch tuples (plain (ids, labels[, packing]) tuples accepted)."""
    return [mb if isinstance(mb, MicroBatch) else MicroBatch(*mb) for mb in batches]


def count_targets(micro_batches: list[MicroBatch]) -> int:
    """Positions with a label (labels != IGNORE_INDEX) over `micro_batches`, counted on the tensors
    the caller passed: host tensors from the data pipeline, so the count costs no device sync
    (counting the device copies would make the host wait for the GPU once per micro-batch)."""
    return sum(
        int((mb.labels != layers.IGNORE_INDEX).sum()) for mb in micro_batches_of(micro_batches)
    )


@dataclass
class StepStats:
    """What one optimizer step measured. Seconds are wall-clock on the host."""

    loss: float  # of the global batch (all data-parallel ranks)
    tokens: int  # input positions this rank processed (B·T·M)
    target_tokens: int  # positions with a label, over the global batch (all ranks)
    grad_norm: float
    phase_seconds: dict[str, float] = field(
        default_factory=dict
    )  # forward, backward, optimizer, h2d_stall, h2d_host: they partition step_seconds
    h2d_bytes: int = 0  # the blocks' weights copied host→device
    # MoE, expert-granular streaming: the share of a streamed block's experts copied, per copy
    expert_share: float | None = None
    offload_h2d_bytes: int = 0  # offloaded block inputs copied back host→device (backward)
    h2d_seconds: float = 0.0  # copy (DMA) time, on the copy stream: overlaps compute
    dequant_seconds: float = 0.0  # dequantizing a quantized base, inside forward and backward
    gpu_busy_seconds: float | None = None  # see StreamedEngine.train_step (CUDA only)
    gpu_busy_ratio: float | None = None  # gpu_busy_seconds / step_seconds (CUDA only)
    # host wall time spent issuing the step's work, up to each wait for the GPU (CUDA only): near
    # step_seconds, the host is the bottleneck (launch-bound) and GPU busy says little
    host_issue_seconds: float | None = None
    # each block's GPU lag behind the host's issue of it (CUDA only: engine/issue_lag.py)
    issue_lag: dict | None = None
    step_seconds: float = 0.0
    flops: float = 0.0
    loss_scale: float | None = None  # float16: the scale this step's backward was seeded with
    skipped_step: bool = False  # float16: a gradient was inf/nan, the parameters did not move

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def batch_sizes(micro_batches: list[MicroBatch]) -> dict[str, int]:
    """A global batch's sizes the plan depends on: its tokens, its biggest micro-batch's tokens,
    its longest sequence."""
    micro_batches = micro_batches_of(micro_batches)
    return {
        "tokens": sum(mb.ids.numel() for mb in micro_batches),
        "biggest": max(mb.ids.numel() for mb in micro_batches),
        "longest": max(mb.ids.shape[-1] for mb in micro_batches),
    }
