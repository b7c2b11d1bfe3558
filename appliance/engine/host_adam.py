"""AdamW on the host for full fine-tuning: fp32 master weights, two fp32 moments, per part.

A *part* is what the streamed step hands over at once: one transformer block ("0", "1", ...), or
the globals ("globals": embeddings, final norm, LM head). Each part has its own fp32 master copy
of its weights and its own `torch.optim.AdamW` over them (the moments live in its state), so
block i can be updated as soon as its gradients are on the host, while the GPU works on other
blocks. AdamW is elementwise: per-part optimizers with the same hyperparameters compute exactly
what one optimizer over the whole model computes.

Host memory per trained parameter (docs/architecture.md, "Full fine-tuning"): the master weight
(4 B), exp_avg (4 B) and exp_avg_sq (4 B) — 12 B — plus the fp32 gradient as it lands from the
device (4 B; held until the step's global norm is known, so clipping stays exact), beside the
compute-dtype weights the forward reads (2 B in bf16; in fp32 the master *is* that copy, so
nothing more). Host memory, not the GPU's: a 7B model's 112 GB of optimizer state fits a
commodity box's RAM, and AdamW is memory-bound, so the CPU's bandwidth, not the GPU's, is what
it costs (`measure_rate` measures it on this host).

After a part's update its compute-dtype weights are written back into the host tensors the
engine streams from (the weight store's writable home), so the next forward reads them.
"""

from __future__ import annotations

import threading
import time

import torch

#: The part that holds the globals (embeddings, final norm, LM head)
GLOBALS = "globals"


def adamw(params: list[torch.Tensor], *, betas, eps, weight_decay, impl: str) -> torch.optim.AdamW:
    """torch's AdamW over `params` (lr set per step). `impl`: "fused" (one vectorised CPU kernel
    per tensor, torch ≥ 2.4), "foreach" or "single" (torch's default on CPU tensors)."""
    flags = {
        "fused": dict(fused=True),
        "foreach": dict(foreach=True),
        "single": dict(foreach=False),
    }
    return torch.optim.AdamW(
        params, lr=0.0, betas=betas, eps=eps, weight_decay=weight_decay, **flags[impl]
    )


class HostAdamW:
    """fp32 master weights and AdamW state for the parts of a model, in host memory.

    `parts`: part name → (tensor name → the compute-dtype host tensor the engine reads, written
    back after each update). `frozen`: tensor names of a part that do not train (no master, no
    moments). In fp32 with `alias` the master is the tensor itself (updated in place, no extra
    copy); data-parallel ranks that share a node's weights must not alias (each would apply its
    update to what another rank already updated), so they keep their own fp32 masters."""

    def __init__(
        self,
        parts: dict[str, dict[str, torch.Tensor]],
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        impl: str = "fused",
        frozen: set[str] = frozenset(),
        alias: bool = True,
    ):
        self.store = {
            p: {k: t for k, t in ts.items() if k not in frozen} for p, ts in parts.items()
        }
        self.master: dict[str, dict[str, torch.Tensor]] = {}
        for p, ts in self.store.items():
            self.master[p] = {
                k: t
                if alias and t.dtype == torch.float32
                else t.detach().to(torch.float32, copy=True)
                for k, t in ts.items()
            }
        self.optimizers = {
            p: adamw(list(m.values()), betas=betas, eps=eps, weight_decay=weight_decay, impl=impl)
            for p, m in self.master.items()
            if m
        }
        self.seconds = 0.0  # host time spent in updates since the last take_seconds
        # updates run on the engine's worker thread, take_seconds on the step's: one lock, so
        # that a take between an update's read and write of `seconds` loses no time
        self._seconds_lock = threading.Lock()

    def num_parameters(self) -> int:
        return sum(t.numel() for m in self.master.values() for t in m.values())

    def trains(self, part: str) -> dict[str, torch.Tensor]:
        """The compute-dtype tensors of `part` that train (name → tensor)."""
        return self.store.get(part, {})

    @torch.no_grad()
    def update(self, part: str, grads: dict[str, torch.Tensor], lr: float, scale: float) -> None:
        """One AdamW step of `part` with its fp32 `grads` multiplied by `scale` (the clipping
        coefficient, 1.0 when none; in place, as clip_grad_norm_ does), then its compute-dtype
        weights written back."""
        if part not in self.optimizers:
            return
        t0 = time.perf_counter()
        master = self.master[part]
        for k, p in master.items():
            g = grads[k]
            if scale != 1.0:
                g.mul_(scale)
            p.grad = g
        opt = self.optimizers[part]
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for k, p in master.items():
            p.grad = None
            t = self.store[part][k]
            if t is not p:
                t.copy_(p)  # the compute dtype, rounded to nearest
        with self._seconds_lock:
            self.seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        with self._seconds_lock:
            s, self.seconds = self.seconds, 0.0
        return s

    # ------------------------------------------------------------ state

    @torch.no_grad()
    def reset(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        """Start over from `parts` (as the constructor's; frozen tensors are not read): the
        weights and masters take them, the moments go (AdamW makes them again at its next step)."""
        for p, store in self.store.items():
            for k, t in store.items():
                t.copy_(parts[p][k])
                if self.master[p][k] is not t:
                    self.master[p][k].copy_(parts[p][k])
        for opt in self.optimizers.values():
            opt.state.clear()

    def state_dict(self) -> dict:
        """Each part's master weights (fp32) and AdamW state: exact resume in any compute dtype."""
        return {
            "master": {p: dict(m) for p, m in self.master.items()},
            "optimizers": {p: o.state_dict() for p, o in self.optimizers.items()},
        }

    def part_state(self, part: str) -> dict:
        """One part's share of state_dict (a checkpoint writes the parts one at a time)."""
        opt = self.optimizers.get(part)
        return {"master": dict(self.master[part]), "optimizer": opt.state_dict() if opt else None}

    def check_part(self, part: str, master: dict) -> None:
        """ValueError naming the first tensor of `part` whose name or shape in `master` differs
        from this model's (another model's state)."""
        for k, t in self.master[part].items():
            if k not in master or tuple(master[k].shape) != tuple(t.shape):
                found = "missing" if k not in master else f"shape {tuple(master[k].shape)}"
                raise ValueError(
                    f"part {part}: {k} is {found}, this model has {tuple(t.shape)}: the "
                    "optimizer state is another model's"
                )

    @torch.no_grad()
    def load_part(self, part: str, state: dict) -> None:
        """Restore part_state's masters and moments of `part`, and write its compute-dtype
        weights back (ValueError as check_part's, before anything changes)."""
        self.check_part(part, state["master"])
        for k, t in self.master[part].items():
            t.copy_(state["master"][k])
            if self.store[part][k] is not t:
                self.store[part][k].copy_(t)
        if part in self.optimizers:
            self.optimizers[part].load_state_dict(state["optimizer"])

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s masters and moments, and write the compute-dtype weights back.
        ValueError naming the first tensor whose name or shape differs (another model's state),
        before anything changes."""
        for p in self.master:
            self.check_part(p, state["master"].get(p, {}))
        for p in self.master:
            opt = state["optimizers"].get(p)
            self.load_part(p, {"master": state["master"][p], "optimizer": opt})


def measure_rate(params: int = 50_000_000, impl: str = "fused", reps: int = 3) -> float:
    """Parameters per second that `impl` AdamW updates on this host (fp32 master and moments,
    all threads torch uses), over `params` parameters in 4 tensors; the best of `reps` steps
    after one warm-up (the first step allocates the moments)."""
    shapes = [(params // 4,)] * 4
    ps = [torch.zeros(s) for s in shapes]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    opt = adamw(ps, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, impl=impl)
    return sum(p.numel() for p in ps) / best_step_seconds(opt, reps)


def best_step_seconds(opt: torch.optim.Optimizer, reps: int) -> float:
    """The best of `reps` timed `opt.step()`s, after one untimed warm-up step (the first step
    allocates the moments)."""
    best = float("inf")
    for r in range(reps + 1):
        t0 = time.perf_counter()
        opt.step()
        if r:
            best = min(best, time.perf_counter() - t0)
    return best
