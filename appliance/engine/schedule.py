"""The learning-rate schedule the step loop gives each step: linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def warmup_for(total_steps: int, warmup_steps: int, warmup_ratio: float | None = None) -> int:
    """A run's warm-up steps: ceil(warmup_ratio × total_steps) with --warmup-ratio (the Hugging
    Face Trainer's rule), else --warmup-steps."""
    if warmup_ratio is not None:
        return math.ceil(total_steps * warmup_ratio)
    return warmup_steps


def lr_at(
    step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
