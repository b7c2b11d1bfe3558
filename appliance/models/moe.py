"""The mixture-of-experts MLP as pure functions: router, experts, load-balancing loss.

The one entry point a family calls (Qwen3-MoE, Mixtral, OLMoE, gpt-oss here; any other MoE
family the same way):

    y, logits = sparse_moe(x, router_weight, experts, routing, router_bias=None)

x (N, C): the block's normed hidden rows (the rows of every sequence, flattened);
router_weight (E, C) [and router_bias (E,)]: the router, a linear layer to E logits;
experts: an `Experts` (per-expert matrices as released checkpoints store them, or the fused 3-D
tensors transformers v5 holds in memory), with the block's LoRA on them if any;
routing: how the family turns logits into k experts and their weights (`Routing`).
Returns y (N, C), the weighted sum of each row's k experts, and the router logits (N, E), which
the load-balancing loss (`load_balance_part`, `LoadBalance`) reads.

The experts run as transformers runs them: a loop over the experts that received at least one
row, each on its rows only (gathered, computed, weighted, scattered back with index_add_ in
ascending expert order). On CUDA a fused 3-D stack without LoRA on its experts runs as one
grouped GEMM instead (torch._grouped_mm, where this PyTorch has it).

Shapes: N rows, C hidden size, E experts, k experts per row, I one expert's MLP width, r rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from appliance.models import layers


@dataclass(frozen=True)
class Routing:
    """How a family's router picks and weights its experts.

    softmax_first: softmax over all E logits (fp32), then the top k probabilities (Qwen3-MoE,
    Mixtral, OLMoE); otherwise the top k logits, then a softmax over those k (gpt-oss).
    renormalize: divide the top k probabilities by their sum (Mixtral always; Qwen3-MoE and OLMoE
    when config.json's norm_topk_prob says so). cast: the weights are cast back to the logits'
    dtype (Qwen3-MoE, OLMoE); Mixtral keeps them in fp32 (each expert's output is weighted in
    fp32, then cast)."""

    top_k: int
    softmax_first: bool = True
    renormalize: bool = False
    cast: bool = True


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k), experts (N, k)) from the router's logits (N, E)."""
    if routing.softmax_first:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, routing.top_k, dim=-1)
        if routing.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if routing.cast else top), index
    top, index = torch.topk(logits, routing.top_k, dim=-1)
    return F.softmax(top, dim=-1, dtype=top.dtype), index


# ---------------------------------------------------------------- experts


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def expert_lora(ab: tuple[torch.Tensor, torch.Tensor], j: int, num: int) -> tuple:
    """Expert j's LoRA factors (B_j (out, r), A_j (r, in)) from PEFT's layout for a 3-D
    parameter (`target_parameters`): A (r·E, in), its rows expert-major; B (out, r·E), its
    columns rank-major (expert fastest)."""
    A, B = ab
    r = A.shape[0] // num
    return B.view(B.shape[0], r, num)[:, :, j], A.view(num, r, A.shape[1])[j]


def _merged(
    w: torch.Tensor, ab: tuple[torch.Tensor, torch.Tensor] | None, j: int, num: int, scale: float
) -> torch.Tensor:
    """w (out, in) of expert j, plus its LoRA update scale·B_j A_j (PEFT merges the update
    into the expert's weight before the matmul: W + scale · B @ A, one baddbmm)."""
    if ab is None:
        return w
    B, A = expert_lora(ab, j, num)
    return torch.addmm(w, B, A, alpha=scale)


#: LoRA module names of the experts (PEFT's `target_parameters` on the fused tensors)
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


class Experts:
    """A block's E experts: `num`, and `forward(j, rows)` for expert j on some rows (n, C).

    Two layouts of the same SwiGLU experts (down(silu(gate x) · up x)):
    - `SplitExperts`: one (I, C) gate, (I, C) up and (C, I) down matrix per expert, named as
      the released Qwen3-MoE / OLMoE (`mlp.experts.{j}.gate_proj.weight`) and Mixtral
      (`block_sparse_moe.experts.{j}.w1.weight`) checkpoints name them;
    - `FusedExperts`: gate_up (E, 2I, C) and down (E, C, I) as transformers v5 holds them.
    LoRA on the experts (`lora`: the LoraContext's (A, B) for GATE_UP and DOWN, PEFT's layout)
    is merged into each expert's weight before its matmul, as PEFT does."""

    num: int

    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def need(self, experts: list[int]) -> None:
        """Called with the experts a batch of rows was routed to, before any of them runs: a
        block whose weights are streamed by expert copies them in now (engine/
        expert_streaming.py). Nothing to do for weights already in place."""


class SplitExperts(Experts):
    def __init__(self, w: dict, names: tuple[str, str, str], num: int, lora=None):
        """`names`: format strings of expert j's gate, up and down weights in `w`."""
        self.w, self.names, self.num = w, names, num
        weights = lora.weights if lora is not None else {}
        self.gate_up, self.down = weights.get(GATE_UP), weights.get(DOWN)
        self.scale = lora.scale if lora is not None else 1.0

    def need(self, experts: list[int]) -> None:
        if hasattr(self.w, "need"):  # expert_streaming.ExpertBlock
            self.w.need(experts)

    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.w[n.format(j)] for n in self.names)
        if self.gate_up is not None:
            gate_up = _merged(torch.cat((gate, up)), self.gate_up, j, self.num, self.scale)
            gate, up = gate_up.chunk(2)
        h = _silu_mul(F.linear(x, gate), F.linear(x, up))
        return F.linear(h, _merged(down, self.down, j, self.num, self.scale))


class FusedExperts(Experts):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, lora=None):
        """gate_up (E, 2I, C): each expert's gate rows then up rows; down (E, C, I)."""
        self.gate_up_w, self.down_w, self.num = gate_up, down, gate_up.shape[0]
        weights = lora.weights if lora is not None else {}
        self.gate_up, self.down = weights.get(GATE_UP), weights.get(DOWN)
        self.scale = lora.scale if lora is not None else 1.0

    def forward(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = _merged(self.gate_up_w[j], self.gate_up, j, self.num, self.scale)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(
            _silu_mul(gate, up), _merged(self.down_w[j], self.down, j, self.num, self.scale)
        )

    def grouped(self) -> bool:
        """Whether the CUDA grouped GEMM can run these experts: on CUDA, bf16, no LoRA on them,
        and a PyTorch with torch._grouped_mm."""
        w = self.gate_up_w
        return (
            w.is_cuda
            and w.dtype == torch.bfloat16
            and self.gate_up is None
            and self.down is None
            and hasattr(torch, "_grouped_mm")
        )


def experts_forward(
    x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """Σ over each row's k experts of weight · expert(row): x (N, C), weights and index (N, k).
    The loop over the experts that received rows (transformers' eager experts, in its order)."""
    if isinstance(experts, FusedExperts) and experts.grouped():
        return _grouped_forward(x, weights, index, experts)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(index, num_classes=experts.num).permute(2, 1, 0)  # (E, k, N)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    experts.need(hit)
    for j in hit:
        pos, rows = torch.where(mask[j])
        y = experts.forward(j, x[rows]) * weights[rows, pos, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def _grouped_forward(
    x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, experts: FusedExperts
) -> torch.Tensor:
    """The experts as two grouped GEMMs (CUDA, bf16): the (row, expert) pairs sorted by expert,
    each expert's rows multiplied by its matrices in one kernel (torch._grouped_mm, offsets the
    cumulative rows per expert), weighted and summed back per row."""
    N, k = index.shape
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    rows = order // k  # the row of each sorted (row, expert) pair
    counts = torch.bincount(flat, minlength=experts.num)
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[rows], experts.gate_up_w.transpose(1, 2), offs=offs)  # (N·k, 2I)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(_silu_mul(gate, up), experts.down_w.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y.to(x.dtype))


def sparse_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    experts: Experts,
    routing: Routing,
    router_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE MLP on rows x (N, C): (output (N, C), router logits (N, E)). The router is never
    adapted (its weight is frozen, as PEFT leaves it)."""
    logits = F.linear(x, router_weight, router_bias)
    weights, index = route(logits, routing)
    return experts_forward(x, weights, index, experts), logits


def experts_used(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """(E,) bool: the experts that at least one row's top k chose (for expert-granular
    streaming: the others need not be on the device)."""
    index = torch.topk(logits, top_k, dim=-1).indices
    return torch.bincount(index.reshape(-1), minlength=logits.shape[-1]) > 0


# ---------------------------------------------------------------- the shared expert

#: the shared expert's linear modules (LoRA targets shared_gate, shared_up, shared_down) and
#: its gate, as Qwen2-MoE and Qwen3.5-MoE checkpoints name them
SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
SHARED_GATE = "mlp.shared_expert_gate.weight"  # (1, C)


def shared_shapes(args) -> dict[str, tuple[int, ...]]:
    """The shared expert's tensors with their shapes (ModelArgs `args`)."""
    out = {f"{m}.weight": args.module_shape(m) for m in SHARED}
    out[SHARED_GATE] = (1, args.hidden_size)
    return out


def shared_expert(
    x: torch.Tensor, w: dict[str, torch.Tensor], lora: layers.LoraContext | None
) -> torch.Tensor:
    """The shared expert on rows x (N, C) (Qwen2-MoE, Qwen3.5-MoE): a dense SwiGLU MLP that
    every row goes through, beside the routed experts, scaled per row by a sigmoid gate:

        sigmoid(x · shared_expert_gateᵀ) · down(silu(gate(x)) · up(x))

    Its three linears are ordinary modules (LoRA adapts them as any projection); the gate is a
    (1, C) linear that PEFT's targets do not name. The caller adds this to the routed experts'
    output (transformers' Qwen2MoeSparseMoeBlock / Qwen3_5MoeSparseMoeBlock)."""
    gate, up, down = SHARED
    h = layers.silu_mul(layers.linear(x, w, gate, lora), layers.linear(x, w, up, lora))
    return torch.sigmoid(F.linear(x, w[SHARED_GATE])) * layers.linear(h, w, down, lora)


# ---------------------------------------------------------------- load balancing


def load_balance_counts(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """(E,) fp32: how many of the rows' top-k choices went to each expert (no gradient)."""
    index = torch.topk(logits.detach(), top_k, dim=-1).indices
    return torch.bincount(index.reshape(-1), minlength=logits.shape[-1]).float()


def load_balance_part(logits: torch.Tensor, counts: torch.Tensor, rows: float) -> torch.Tensor:
    """One block's share of transformers' load-balancing loss (Switch Transformer eq. 4–6, as
    `load_balancing_loss_func` computes it over every MoE block's logits of the batch):

        aux = E · Σ_e (counts_e / R) · (Σ_rows p_e / R)

    counts (E,): the top-k choices per expert over every MoE block and row of the batch (no
    gradient in transformers either); R: those blocks × rows; p = softmax(logits). The sum over
    blocks and rows is linear in p, so each block's part, computed from its own logits,
    gives the whole loss and its exact gradient when the parts are summed."""
    probs = F.softmax(logits, dim=-1).float()
    return logits.shape[-1] * (counts / rows * probs.sum(dim=0) / rows).sum()


class LoadBalance:
    """The streamed step's bookkeeping for the load-balancing loss (models.moe_aux_coef > 0).

    The forward `observe`s each MoE block's router logits of each micro-batch (counts and rows
    summed); after it, `part(logits)` is that block's share of coef · aux (load_balance_part),
    differentiable, for the backward's recompute to add to the block's output."""

    def __init__(self, coef: float, top_k: int, num: int):
        self.coef, self.top_k, self.num = coef, top_k, num
        self.counts: torch.Tensor | None = None
        self.rows = 0.0
        self._probs: torch.Tensor | None = None

    @classmethod
    def of(cls, args) -> LoadBalance | None:
        """One step's bookkeeping for ModelArgs `args`, when config.json asks for the loss (a
        MoE model with output_router_logits: router_aux_loss_coef × the loss, added to the
        training loss as transformers adds it; evaluation losses leave it out); else None."""
        if not (args.num_experts and args.router_aux_coef):
            return None
        return cls(args.router_aux_coef, args.experts_per_token, args.num_experts)

    def observe(self, logits: list[torch.Tensor]) -> None:
        for lg in logits:
            counts = load_balance_counts(lg, self.top_k)
            probs = F.softmax(lg, dim=-1).float().sum(dim=0)
            self.counts = counts if self.counts is None else self.counts + counts
            self._probs = probs if self._probs is None else self._probs + probs
            self.rows += lg.shape[0]

    def loss(self, group=None) -> torch.Tensor:
        """coef · aux over what was observed (0 when nothing was). With a data-parallel
        `group`, the counts and rows are summed over it first (every rank's `part`s then use
        the global batch's), and the loss is this rank's share: summed over the ranks, the
        global batch's."""
        if group is not None:
            import torch.distributed as dist

            counts = self.counts if self.counts is not None else torch.zeros(self.num)
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            totals = torch.cat(
                [counts.float().to(device), torch.tensor([self.rows], device=device)]
            )
            dist.all_reduce(totals, group=group)
            self.counts, self.rows = totals[:-1], float(totals[-1])
        if self._probs is None:  # this rank observed nothing: no share of the loss
            return torch.zeros(())
        E = self.counts.shape[0]
        return self.coef * E * (self.counts / self.rows * self._probs / self.rows).sum()

    def part(self, logits: list[torch.Tensor]) -> torch.Tensor | None:
        """coef · the share of the aux loss of these logits (one block, one micro-batch)."""
        if not logits or self.counts is None:
            return None
        return self.coef * sum(load_balance_part(lg, self.counts, self.rows) for lg in logits)


# ---------------------------------------------------------------- a family's MoE MLP


@dataclass(frozen=True)
class Layout:
    """Where a family's checkpoint keeps a block's router and experts (names without the
    `model.layers.{i}.` prefix; `{}` is the expert's number)."""

    router: str  # (E, C)
    gate: str  # (I, C) per expert
    up: str  # (I, C)
    down: str  # (C, I)

    def shapes(self, args) -> dict[str, tuple[int, ...]]:
        """The router's and every expert's tensors with their shapes (ModelArgs `args`)."""
        C, width = args.hidden_size, args.moe_intermediate_size
        out: dict[str, tuple[int, ...]] = {self.router: (args.num_experts, C)}
        for j in range(args.num_experts):
            out[self.gate.format(j)] = (width, C)
            out[self.up.format(j)] = (width, C)
            out[self.down.format(j)] = (C, width)
        return out

    def expert_weights(self, args) -> list[str]:
        """The experts' weights (what a quantized base quantizes), expert by expert."""
        return [
            n.format(j) for j in range(args.num_experts) for n in (self.gate, self.up, self.down)
        ]

    def expert_of(self, name: str) -> int | None:
        """The expert a tensor name belongs to (None: not an expert's)."""
        for pattern in (self.gate, self.up, self.down):
            head, _, tail = pattern.partition("{}")
            if name.startswith(head) and name.endswith(tail):
                middle = name[len(head) : len(name) - len(tail)]
                if middle.isdigit():
                    return int(middle)
        return None


def split_moe_mlp(
    h: torch.Tensor,
    w: dict[str, torch.Tensor],
    layout: Layout,
    args,
    routing: Routing,
    lora=None,
    router_logits: list | None = None,
) -> torch.Tensor:
    """A family's MoE MLP on normed rows h (N, C), its experts stored per expert (`layout`);
    appends the router logits to `router_logits` when given (the load-balancing loss)."""
    experts = SplitExperts(w, (layout.gate, layout.up, layout.down), args.num_experts, lora)
    y, logits = sparse_moe(h, w[layout.router], experts, routing)
    if router_logits is not None:
        router_logits.append(logits)
    return y
