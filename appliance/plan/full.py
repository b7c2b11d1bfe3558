"""Full fine-tuning's host side, as arithmetic: memory per parameter by part, the gradients'
device→host bytes, the CPU optimizer's time, and which of them binds the step.

Per trained parameter, per trainer (engine/full.py, engine/host_adam.py):

    weights        the compute-dtype copy the forward streams (the weight store's writable home,
                   /dev/shm, once per node): 2 B in bf16, 4 B in fp32
    master         the fp32 master weight: 4 B, none in fp32 (the weights are the master)
    moments        AdamW's exp_avg and exp_avg_sq, fp32: 8 B
    grad_buffers   the fp32 gradient landed from the device, kept until the global norm is known
                   (exact clipping): 4 B (page-locked on a GPU)

so 18 B per parameter in bf16 (16 B in fp32), against a LoRA run's 2 B: a 7B model needs about
126 GB of host memory, a 70B one 1.3 TB. Each data-parallel trainer holds its own master, moments
and gradients (the weights are shared on a node). On the GPU: the globals' fp32 gradients, two
blocks' fp32 gradients and one block's in the compute dtype (FullFinetuneEngine.plan_inputs).

The step moves each block's fp32 gradients device→host once (4 B per parameter), beside the
host→device weight traffic, on the other direction of the link. The CPU's AdamW runs beside the
GPU; it binds when it takes longer than the GPU's step. Its rate is measured on the host
(`host_adam.measure_rate`: `appliance doctor` does) or taken from ADAMW_PARAMS_PER_SECOND.
"""

from __future__ import annotations

from appliance.models import block_param_count, param_count
from appliance.models.layers import ModelArgs

#: fused CPU AdamW, parameters per second, all cores of a 2-core VM (2026-11-28, docs/benchmarks.md,
#: "AdamW on the host"): the rate the plan assumes when it is not told this host's
ADAMW_PARAMS_PER_SECOND = 2.0e8


def embedding_params(args: ModelArgs) -> int:
    return args.vocab_size * args.hidden_size


def trained_params(args: ModelArgs, freeze_embeddings: bool = False) -> int:
    """Parameters a full fine-tune trains: all of them, less the input embeddings if frozen."""
    n = param_count(args)
    return n - embedding_params(args) if freeze_embeddings else n


def host_bytes(
    args: ModelArgs, dtype_bytes: int, freeze_embeddings: bool = False, trainers: int = 1
) -> dict[str, int]:
    """Host memory of a full fine-tune on one node of `trainers` trainers, by part (bytes)."""
    n = trained_params(args, freeze_embeddings)
    parts = {
        "weights": param_count(args) * dtype_bytes,
        # fp32 with one trainer: the weights are the master; ranks keep their own
        "master": trainers * n * (0 if dtype_bytes == 4 and trainers == 1 else 4),
        "moments": trainers * n * 8,
        "grad_buffers": trainers * n * 4,
    }
    parts["total"] = sum(parts.values())
    return parts


def gpu_grad_bytes(args: ModelArgs, dtype_bytes: int, freeze_embeddings: bool = False) -> int:
    """The device's gradient buffers (FullFinetuneEngine.grad_buffer_bytes, from the shapes)."""
    glob = param_count(args) - args.num_layers * block_param_count(args)
    if freeze_embeddings:  # (tied: the LM head is the embedding, frozen too)
        glob -= embedding_params(args)
    return glob * 4 + block_param_count(args) * (2 * 4 + dtype_bytes)


def blocks_uploaded_per_step(num_blocks: int, resident_blocks: int) -> int:
    """Host→device block copies in one full fine-tune step: every block's weights change each
    step, so a resident block is copied once (after its update) and a streamed one twice; only
    the last block, with none resident, stays from the forward into the backward (block 0,
    kept into the next forward in a LoRA run, is copied again after its update)."""
    resident = min(max(resident_blocks, 0), num_blocks)
    streamed = num_blocks - resident
    return resident + 2 * streamed - (1 if resident == 0 and streamed else 0)


def step_costs(
    args: ModelArgs,
    freeze_embeddings: bool,
    d2h_bytes_per_second: float,
    adamw_params_per_second: float = ADAMW_PARAMS_PER_SECOND,
) -> dict[str, float]:
    """Per step: the gradients' device→host bytes and seconds, and the CPU AdamW's seconds."""
    n = trained_params(args, freeze_embeddings)
    return {
        "d2h_bytes_per_step": 4.0 * n,
        "d2h_seconds": 4.0 * n / d2h_bytes_per_second,
        "optimizer_seconds": n / adamw_params_per_second,
        "adamw_params_per_second": adamw_params_per_second,
    }


def binds(seconds: dict[str, float]) -> str:
    """Which of {"host→device": s, "device→host": s, "compute": s, "cpu optimizer": s} bounds
    the step: the longest (they overlap)."""
    return max(seconds, key=seconds.__getitem__)


def host_problem(
    args: ModelArgs,
    dtype_bytes: int,
    available: int,
    freeze_embeddings: bool = False,
    trainers: int = 1,
) -> str | None:
    """One line when a full fine-tune cannot fit `available` bytes of host memory, naming its
    parts and the flags that would make it fit; None when it fits."""
    need = host_bytes(args, dtype_bytes, freeze_embeddings, trainers)
    if need["total"] <= available:
        return None
    gib = 2**30
    parts = ", ".join(f"{k.replace('_', ' ')} {need[k] / gib:.1f}" for k in need if k != "total")
    fixes = []
    if not freeze_embeddings:
        frozen = host_bytes(args, dtype_bytes, True, trainers)["total"]
        if frozen <= available:
            fixes.append("--freeze-embeddings")
    if trainers > 1:
        one = host_bytes(args, dtype_bytes, freeze_embeddings, 1)["total"]
        if one <= available:
            fixes.append("--trainers 1")
    fixes.append("--finetuning-type lora (an adapter: 2 B per parameter)")
    return (
        f"--finetuning-type full: host memory needs {need['total'] / gib:.1f} GiB ({parts} GiB: "
        f"{need['total'] / max(trained_params(args, freeze_embeddings), 1) / trainers:.0f} B per "
        f"trained parameter) and this box has {available / gib:.1f} GiB available: "
        f"{' or '.join(fixes)}, or a host with more memory"
    )


def adamw_check(params: int = 20_000_000) -> tuple[str, str, str]:
    """`appliance doctor`'s (status, detail, fix) for the CPU AdamW of a full fine-tune: its
    measured rate on this host (fused, all threads; a second or so), and what it means for 7B."""
    import torch

    from appliance.engine.host_adam import measure_rate
    from appliance.models.presets import PRESETS

    rate = measure_rate(params)
    seconds = trained_params(PRESETS["7b"].args) / rate
    threads = torch.get_num_threads()
    detail = (
        f"fused CPU AdamW: {rate / 1e6:.0f} M params/s on {threads} threads "
        f"({rate / threads / 1e6:.0f} M per core): {seconds:.1f} s a step for a 7B full "
        "fine-tune, beside the GPU (--finetuning-type full)"
    )
    return "ok", detail, ""
