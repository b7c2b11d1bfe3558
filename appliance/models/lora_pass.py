"""A block's LoRA weights for one pass: one cast of one flat buffer, one add per micro-batch back.

`LoraWeights` keeps each block's fp32 parameters in one flat buffer, every A then every B in the
block's module order (the parameters are views of it). For a pass over a block (the engine's
layer-major forward, or its recompute + backward) `gather` makes the compute-dtype weights in one
copy of that buffer, with a power-of-two scale folded into the B half in one multiply, and hands
out views of it per module. What a per-module path does in 2 to 3 operators per module and pass
(a cast each for A and B, B's multiply), this does in 2.

In the backward, each micro-batch's gradients reach `_Gather.backward` together: they are
concatenated into one flat buffer (in the compute dtype, as the per-module casts' backward gets
them), B's half multiplied by the folded scale (the multiply's backward), and added into the
block's fp32 gradient buffer in one add (the first micro-batch of a step copies instead), whose
views are the parameters' `.grad`. A per-module path runs a cast back to fp32 for each of A and B,
B's multiply, and an accumulation for each: about 35 operators per Llama block and micro-batch,
where this runs 3 kernels (and a view per module, which launches nothing). Every number is the
per-module path's: the casts are exact, the multiply is the same bf16 multiply, and the fp32 add
of a bf16 value is the add of its exact fp32 cast (tests/engine/test_lora_pass.py checks it bit
for bit against the per-module casts, and the parity suite against PEFT).

So autograd never accumulates into the fp32 parameters: a hook registered on one of them
(`Tensor.register_hook`) is called with None. A hook on a pass's views (`LoraContext.weights`)
sees that pass's compute-dtype gradient.

`chunks` partitions the flat buffer into the tensors the pass hands out: each A and each B on its
own (the exact kernels), or, for `--kernels fast`, the A's of projections that read the same
input (q, k, v; gate, up) as one stacked tensor: one matmul for their three (two) A's
(layers.linear, LoraContext.stacked). They are adjacent in the buffer, so stacking them copies
nothing.
"""

from __future__ import annotations

import torch

# projections that read one input, whose A's the fast kernels multiply in one matmul
SHARED_INPUT = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


class BlockBuffers:
    """One block's LoRA parameters as views of one flat fp32 buffer, and the gradient's buffer.

    `modules`: module → ((r, in), (out, r)) in the block's order. The buffer holds every A, then
    every B; `params[m] = (A, B)` are leaf views of it (the optimizer's parameters), and
    `grad_views` the matching views of `grad` (allocated on first use), which become their
    `.grad` when a backward first reaches them in a step."""

    def __init__(
        self,
        modules: dict[str, tuple[tuple[int, int], tuple[int, int]]],
        flat: torch.Tensor,
    ):
        self.names = list(modules)
        self.shapes = [a for a, _ in modules.values()] + [b for _, b in modules.values()]
        self.sizes = [r * c for r, c in self.shapes]
        self.n_a = sum(self.sizes[: len(self.names)])
        self.flat = flat
        views = [v.view(s) for v, s in zip(flat.split(self.sizes), self.shapes, strict=True)]
        k = len(self.names)
        self.params = {m: (views[j], views[k + j]) for j, m in enumerate(self.names)}
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []

    def leaves(self) -> list[torch.Tensor]:
        """The parameters in flat order: every A, then every B."""
        return [ab[0] for ab in self.params.values()] + [ab[1] for ab in self.params.values()]

    def to(self, device: torch.device | str) -> BlockBuffers:
        moved = BlockBuffers(
            dict(zip(self.names, self._pairs(), strict=True)), self.flat.to(device)
        )
        for p in moved.leaves():
            p.requires_grad_(True)
        return moved

    def _pairs(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        k = len(self.names)
        return [(self.shapes[j], self.shapes[k + j]) for j in range(k)]

    def chunks(self, stack: bool) -> list[tuple[list[str], str, tuple[int, int]]]:
        """How a pass cuts the flat buffer: (modules, "A" | "B", shape) for consecutive pieces;
        `stack`: shared-input A's as one piece (SHARED_INPUT, where the block has all of a
        group, in a row, of one input width and rank)."""
        k, out, j = len(self.names), [], 0
        while j < k:
            group = (
                next((g for g in SHARED_INPUT if g[0] == self.names[j]), None) if stack else None
            )
            n = len(group) if group else 1
            members, shapes = self.names[j : j + n], self.shapes[j : j + n]
            if group and (tuple(members) != group or len({s for s in shapes}) != 1):
                members, shapes, n = members[:1], shapes[:1], 1
            out.append((members, "A", (sum(s[0] for s in shapes), shapes[0][1])))
            j += n
        out += [([m], "B", self.shapes[k + j]) for j, m in enumerate(self.names)]
        return out


class _Gather(torch.autograd.Function):
    """Forward: the flat fp32 buffer cast once, B's half scaled once, cut into `chunks`.
    Backward: the chunks' gradients into the block's fp32 gradient buffer in one add (module
    docstring). The inputs are the parameters, only so that autograd calls the backward: it
    returns no gradient for them (None) and writes their `.grad` itself."""

    @staticmethod
    def forward(ctx, block: BlockBuffers, dtype, fold, chunks, *leaves):
        ctx.set_materialize_grads(False)  # a chunk a micro-batch did not use: None
        ctx.block, ctx.fold, ctx.chunks = block, fold, chunks
        flat = block.flat.to(dtype, copy=True)
        if fold is not None:
            flat[block.n_a :].mul_(fold)
        sizes = [s[0] * s[1] for _, _, s in chunks]
        return tuple(v.view(s) for v, (_, _, s) in zip(flat.split(sizes), chunks, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        block = ctx.block
        if all(g is not None for g in grads):
            flat = torch.cat([g.reshape(-1) for g in grads])
            if ctx.fold is not None:
                flat[block.n_a :].mul_(ctx.fold)  # the folded multiply's backward
            _accumulate(block, flat)
        else:  # some projection not run (e.g. a block that reuses another's K/V): per chunk
            _accumulate_some(block, ctx.chunks, grads, ctx.fold)
        return (None,) * (4 + len(block.leaves()))


def _accumulate(block: BlockBuffers, flat: torch.Tensor) -> None:
    """Add one micro-batch's whole flat gradient into the block's fp32 gradient: one copy (the
    step's first micro-batch) or one add, when every parameter's `.grad` is the buffer's view."""
    leaves = block.leaves()
    if block.grad is None or block.grad.device != flat.device:
        block.grad = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
        block.grad_views = [
            v.view(s) for v, s in zip(block.grad.split(block.sizes), block.shapes, strict=True)
        ]
    if all(p.grad is None for p in leaves):
        block.grad.copy_(flat)
        for p, v in zip(leaves, block.grad_views, strict=True):
            p.grad = v
    elif all(p.grad is v for p, v in zip(leaves, block.grad_views, strict=True)):
        block.grad.add_(flat)
    else:  # someone set .grad to tensors of their own: add into each
        for p, g in zip(leaves, flat.split(block.sizes), strict=True):
            _add_into(p, g.view(p.shape))


def _accumulate_some(block: BlockBuffers, chunks, grads, fold: float | None) -> None:
    """The micro-batch's gradients module by module, leaving untouched (`.grad` None, as PEFT
    leaves them) the parameters whose projection did not run."""
    leaves = {id(p): p for p in block.leaves()}
    for (members, which, _), g in zip(chunks, grads, strict=True):
        if g is None:
            continue
        if which == "B" and fold is not None:
            g = g * fold
        parts = g.split([block.params[m][0].shape[0] for m in members]) if which == "A" else [g]
        for m, part in zip(members, parts, strict=True):
            p = block.params[m][0 if which == "A" else 1]
            _add_into(leaves[id(p)], part)


def _add_into(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    else:
        p.grad.add_(g)


def gather(
    block: BlockBuffers, dtype: torch.dtype, fold: float | None, stack: bool
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, tuple[torch.Tensor, int]]]:
    """Block's weights for one pass in `dtype`: module → (A, B), B times `fold` when given;
    and with `stack`, module → (the stacked A of its shared-input group, its index in it)."""
    chunks = block.chunks(stack)
    outs = _Gather.apply(block, dtype, fold, chunks, *block.leaves())
    weights: dict[str, list] = {m: [None, None] for m in block.names}
    stacked: dict[str, tuple[torch.Tensor, int]] = {}
    for (members, which, _), t in zip(chunks, outs, strict=True):
        if which == "B":
            weights[members[0]][1] = t
        elif len(members) == 1:
            weights[members[0]][0] = t
        else:  # each member's A is a row range of the stack (used where the stack is not)
            rows = [block.params[m][0].shape[0] for m in members]
            for j, (m, a) in enumerate(zip(members, t.split(rows), strict=True)):
                weights[m][0] = a
                stacked[m] = (t, j)
    return {m: (a, b) for m, (a, b) in weights.items()}, stacked
