"""The engine's planner as pure arithmetic: GPU memory by part, residency, uploads (FLOPs:
engine/flops.py).

`StreamedEngine.plan` calls `plan_memory` with what it holds (its blocks' bytes, its LoRA
parameters, the real batch); `appliance plan` calls it with what config.json implies. Both decide
with the same numbers, and nothing here needs weights or a GPU — but for `gpu_memory_cap`, which
holds a process's allocator to the budget the plan was made for.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from appliance.models import gated_deltanet
from appliance.models.layers import HEAD_CHUNK_VALUES, ModelArgs


@dataclass(frozen=True)
class MemoryPlan:
    """Where one trainer's GPU memory goes (bytes) and which blocks stay resident."""

    budget: int
    globals_bytes: int  # embeddings, final norm, LM head on the device
    lora_bytes: int  # LoRA parameter, gradient and two Adam moments, fp32
    work_bytes: int  # transient: the step's hidden states and their gradients, one
    # micro-batch through one block, and the fp32 head
    activation_bytes: int  # every block's saved input, for every micro-batch of the step
    offload_activations: bool  # saved inputs live in pinned host memory instead
    block_bytes: int  # one block as uploaded
    num_blocks: int
    resident_blocks: int  # the last `resident_blocks` stay on the device; < 0: does not fit

    @property
    def fits(self) -> bool:
        return self.resident_blocks >= 0

    @property
    def streaming_slots(self) -> int:
        """Device slots for blocks in flight: two when any block streams, else none."""
        return 0 if self.resident_blocks >= self.num_blocks else 2

    @property
    def device_activation_bytes(self) -> int:
        """Saved inputs on the device: all of them, or offloaded, the two blocks' worth in the
        device slots they come back through (saved_inputs.SavedInputs)."""
        return device_saved_bytes(self.activation_bytes, self.num_blocks, self.offload_activations)

    @property
    def min_bytes(self) -> int:
        """The least budget that runs at all: fixed parts, working set, two streaming slots."""
        return self.globals_bytes + self.lora_bytes + self.work_bytes + 2 * self.block_bytes

    def gpu_bytes(self) -> dict[str, int]:
        """Device bytes by part (the budget itself is not a part)."""
        parts = {
            "resident_blocks": max(self.resident_blocks, 0) * self.block_bytes,
            "streaming_slots": self.streaming_slots * self.block_bytes,
            "activations": self.device_activation_bytes,
            "lora_optimizer": self.lora_bytes,
            "globals": self.globals_bytes,
            "working_set": self.work_bytes,
        }
        parts["total"] = sum(parts.values())
        return parts


#: Device memory the plan leaves unplanned: what lives outside the planned parts but inside the
#: card (cuBLAS workspaces, NCCL buffers, the caching allocator's rounding and fragmentation).
MiB, GiB = 2**20, 2**30
CUDA_MARGIN_BYTES = 768 * MiB


def effective_budget(requested: int | None, total: int, free: int, reserved: int) -> int:
    """The device bytes the plan may use: the budget asked for (`--gpu-memory-budget`; default 90%
    of the card's `total`), but never more than the card can give this process now (`free`, as
    torch.cuda.mem_get_info says, plus `reserved`: what this process's caching allocator already
    holds), less CUDA_MARGIN_BYTES. A budget larger than the card is thus not trusted, and the
    CUDA context, which lives outside PyTorch's allocator, is already missing from `free`."""
    asked = requested if requested is not None else int(total * 0.9)
    return min(asked, free + reserved) - CUDA_MARGIN_BYTES


def plan_memory(
    args: ModelArgs,
    *,
    dtype_bytes: int,
    budget: int,
    tokens: int,
    biggest: int,
    block_bytes: int,
    globals_bytes: int,
    lora_params: int,
    longest: int = 0,
) -> MemoryPlan:
    """Decide residency for one step of `tokens` positions (its biggest micro-batch: `biggest`).

    Saved activations go to the host when they would take more than half of what is left after
    the fixed parts and the working set; then as many blocks as fit stay resident, keeping two
    slots for the blocks in flight when not all of them fit. `longest`: the longest sequence of
    a micro-batch, for attention that writes out its scores.
    """
    L, C = args.num_layers, args.hidden_size
    lora = lora_params * 4 * 4  # param, grad, two Adam moments (fp32)
    saved = L * tokens * C * dtype_bytes
    # the step's hidden states: the last block's outputs for every micro-batch, then their
    # gradients, both held at the head (the backward then carries one of them block to block)
    work = 2 * tokens * C * dtype_bytes
    # one micro-batch through one block
    work += biggest * (6 * C + 4 * args.intermediate_size) * dtype_bytes * 2
    # the head, one sequence chunk at a time (layers.HEAD_CHUNK_VALUES): fp32 logits, their
    # softmax and its gradient
    work += min(biggest * args.vocab_size, HEAD_CHUNK_VALUES) * 4 * 3
    if args.linear_num_value_heads:  # Qwen3.5: the chunked rule's fp32 matrices (gated_deltanet)
        work += gated_deltanet.work_bytes(args, biggest)
    if args.attn_softcap is not None:  # Gemma 2: layers.attend writes out (B, nh, T, T) scores
        # (`longest` = T), kept for the backward with their tanh and fp32 softmax
        work += biggest * longest * args.num_heads * (4 + 3 * dtype_bytes)
    free = budget - globals_bytes - lora - work
    offload = saved > free // 2
    free -= device_saved_bytes(saved, L, offload)
    resident = L if free >= L * block_bytes else min(L, free // block_bytes - 2)
    return MemoryPlan(
        budget, globals_bytes, lora, work, saved, offload, block_bytes, L, int(max(resident, -1))
    )


def device_saved_bytes(saved: int, num_blocks: int, offload: bool) -> int:
    """Device bytes of the saved block inputs: all of them, or offloaded, two blocks' worth (the
    device slots they come back through, saved_inputs.SavedInputs)."""
    return 2 * saved // num_blocks if offload else saved


def streaming_budget(args: ModelArgs, *, stream_fraction: float = 0.5, **inputs) -> int | None:
    """The largest `--gpu-memory-budget` (a multiple of a quarter block, CUDA_MARGIN_BYTES included)
    under which the plan fits and at least `stream_fraction` of the blocks stream; None if no
    budget does. `inputs`: plan_memory's other arguments (StreamedEngine.plan_inputs). What
    `appliance bench` runs its streamed row at unless told a budget: a budget under which every
    block stays resident would time ordinary training, not streaming."""
    L = args.num_layers
    # steps of a quarter block (a MiB at least, 256 MiB at most): fine enough to land between
    # two residency counts, few enough to be quick (each plan is arithmetic)
    step = max(2**20, min(256 * 2**20, inputs["block_bytes"] // 4 // 2**20 * 2**20))
    best = None
    for k in range(1, 2**40 // step + 1):  # up to 1 TiB
        p = plan_memory(args, budget=k * step, **inputs)
        if p.fits and L - p.resident_blocks < stream_fraction * L:
            break
        if p.fits:
            best = k * step + CUDA_MARGIN_BYTES
    return best


def blocks_uploaded_per_step(num_blocks: int, resident_blocks: int) -> int:
    """Host→device block copies in one steady-state optimizer step (both passes).

    Streamed blocks (the first L − r) are copied once in the forward and once in the backward,
    less two that never leave: block 0 stays after the backward for the next forward, and with
    no resident block the last block stays from the forward into the backward.
    """
    streamed = num_blocks - max(resident_blocks, 0)
    if streamed <= 0:
        return 0
    return 2 * streamed - 1 - (1 if resident_blocks <= 0 else 0)


def gpu_budget_problem(text: str, n: int) -> str | None:
    """What is wrong with `--gpu-memory-budget TEXT` (`n`: its bytes, config.parse_bytes), or
    None: a bare number under 1 MiB (`24` is 24 bytes: a unit left out, said when `24GiB` would
    do), or a budget not above CUDA_MARGIN_BYTES, which the engine keeps off every
    budget (0 included), so that nothing would be left to plan."""
    text = str(text).strip()
    bare = re.fullmatch(r"\d+(\.\d+)?", text) and n < MiB  # and TEXT GiB would do:
    if bare and float(text) * GiB > CUDA_MARGIN_BYTES:
        unit = "byte" if n == 1 else "bytes"
        return f"--gpu-memory-budget {text} is {n} {unit}: did you mean {text}GiB?"
    if n <= CUDA_MARGIN_BYTES:
        return (
            f"--gpu-memory-budget {text} leaves nothing to plan: the engine keeps "
            f"{CUDA_MARGIN_BYTES // MiB} MiB of any budget for cuBLAS, NCCL and fragmentation; "
            "give more (e.g. 20GiB), or leave it out for 90% of the card"
        )
    return None


@contextlib.contextmanager
def gpu_memory_cap(device: torch.device, budget: int | None) -> Iterator[None]:
    """Hold this process's CUDA allocator to `budget` bytes of `device` inside the block, and lift
    the cap when it ends, however it ends. The cap is process-wide (torch's
    set_per_process_memory_fraction), so it belongs to whoever owns the process's GPU work — the
    Trainer, the bench — not to an engine: an engine left unclosed would otherwise hold the next
    one to its budget (on the first GPU run a 24 MiB cap was left behind, and the next three
    tests ran out of memory). Nothing on a CPU or without a budget."""
    capped = device.type == "cuda" and bool(budget)
    if capped:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    try:
        yield
    finally:
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
