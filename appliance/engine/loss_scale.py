"""Dynamic loss scaling for float16 compute (docs/architecture.md, "Numerics that must hold").

float16 has 5 exponent bits: gradients below 2**-24 flush to zero, and many more lose bits as
subnormals. The engine therefore seeds the head's backward with loss·scale instead of loss, so
every gradient the blocks compute in float16 is `scale` times larger, and divides the fp32 LoRA
gradients by `scale` before clipping and AdamW. Scales are powers of two, so both multiplications
are exact: absent overflow and underflow, the unscaled gradients do not depend on the scale.

Too large a scale overflows to inf/nan. Then the step is skipped (no update, gradients dropped)
and the scale halved; after `growth_interval` good steps in a row it doubles, probing for the
largest scale that fits. The rules and defaults are torch.amp.GradScaler's; this class only keeps
the scale and decides, the engine applies it to its streamed step (appliance/engine/step.py).
"""

from __future__ import annotations

import torch


class LossScaler:
    """The loss scale of a float16 run and the count of good steps since it last changed."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("loss scaling needs init_scale > 0, growth > 1, 0 < backoff < 1")
        if growth_interval < 1:
            raise ValueError("growth_interval must be at least 1")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0  # finite steps in a row since the scale last changed

    def unscale_(self, params: list[torch.Tensor]) -> None:
        """Divide the gradients of `params` by the scale, in place (exact for a power of two)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After a step: a non-finite gradient backs the scale off (and restarts the count);
        `growth_interval` finite steps in a row grow it."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict) -> None:
        """Everything comes back, the rules too (as GradScaler's): a resumed run scales as the
        uninterrupted one would have."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
