"""`train --micro-batches-per-step auto` on a GPU: `appliance plan`'s rule for M
(estimate.choose_micro_batches), fed with the B, P and memory measured on the trainer's own GPU
instead of a class's figures from hardware.GPUS. On a CPU weights are read in place and M is
CPU_AUTO_M.
"""

from __future__ import annotations

from appliance.engine.blocks import dtype_from_name
from appliance.hardware import gpus as hardware
from appliance.hardware.measure import measure_bandwidth, measure_matmul
from appliance.models.layers import ModelArgs
from appliance.plan.estimate import PlanInput, choose_micro_batches
from appliance.plan.shape import gpu_micro_batch

CPU_AUTO_M = 4  # on a CPU weights are read in place: nothing to amortize


def measure_this_gpu(dtype: str = "bfloat16") -> dict:
    """B (pinned host→device bytes/s), P (matmul FLOP/s in the compute dtype `dtype`) and
    memory of CUDA device 0: a second or two (bench's own measurements). Run it where the
    trainer's GPU is visible."""
    import torch

    dev = torch.device("cuda", 0)
    return {
        "h2d_bytes_per_second": measure_bandwidth(dev, 256 * 2**20, reps=3),
        "flops_per_second": measure_matmul(dev, dtype_from_name(dtype), 4096, 10),
        "memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
        "name": torch.cuda.get_device_name(dev),
    }


def auto_micro_batches(args: ModelArgs, measured: dict, **shape) -> tuple[int, str]:
    """`train --micro-batches-per-step auto` on a GPU: plan's rule (choose_micro_batches) with
    the B, P and memory measured on this box (`measure_this_gpu`). The host is what it is here
    (doctor checks it), so only the GPU must fit. `shape`: measured_plan's. Returns (M, why)."""
    return choose_micro_batches(measured_plan(args, measured, None, **shape))


def gpu_micro_batch_shape(
    args: ModelArgs, measured: dict, micro_batches: int, **shape
) -> tuple[int, int, str]:
    """train on a GPU with `--micro-batch-size` left at its default: plan/shape.py's rows and
    micro-batches a step (the same tokens a step) on this box's measured GPU. Returns (rows, M,
    why)."""
    return gpu_micro_batch(measured_plan(args, measured, micro_batches, **shape), micro_batches)


def measured_plan(
    args: ModelArgs,
    measured: dict,
    micro_batches: int | None,
    *,
    seq_len: int,
    micro_batch_size: int,
    lora_rank: int,
    lora_targets: tuple[str, ...],
    dtype_bytes: int,
    budget: int | None,
    base_quant: str = "none",
    finetuning_type: str = "lora",
) -> PlanInput:
    """The plan's input for this run on this box's GPU (`measure_this_gpu`)."""
    gpu = hardware.Gpu(
        measured["name"],
        measured["memory_bytes"],
        measured["h2d_bytes_per_second"],
        measured["flops_per_second"],
        measured["flops_per_second"],
        True,
        hardware.Instance("this box", 1, 2**62, None),  # host RAM: not the question here
        "measured at start",
    )
    return PlanInput(
        args,
        "this run",
        "measured",
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        micro_batches_per_step=micro_batches,
        base_quant=base_quant,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        gpu_memory_budget=budget,
        dtype_bytes=dtype_bytes,
        measured=gpu,
        finetuning_type=finetuning_type,
    )
