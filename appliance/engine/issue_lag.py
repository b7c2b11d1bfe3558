"""Launch-bound or GPU-bound, without the profiler: how far the GPU's work on each block lags
the host's issue of it.

When the host has issued a block's work (its micro-batches, in one pass), a CUDA event is
recorded on the compute stream and the host's clock read. After the step's sync, each event's
GPU time is put on the host's clock through one anchor (an event recorded, with the host's
clock, at the start of the step, when the stream is idle: train_step ends with a sync). The lag
of a block is its event's time less the host's time at issue:

- near zero all through a pass: the GPU finished each block as soon as the host had issued it,
  so it waited for the host: launch-bound;
- growing through a pass: the GPU falls further behind the host block by block: GPU-bound (until
  CUDA's launch queue is full and the host blocks in a launch; the lag then stays high).

On a CPU nothing is recorded (the work is done when the host returns: there is no lag to
measure); `take` returns None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PASSES = ("forward", "backward")
_clock = time.perf_counter  # the host's clock (a test swaps in one that ticks by exactly 1 s)


def lag_stats(marks: list[tuple[str, int, float, float]]) -> dict | None:
    """The figures from (pass, block, host seconds at issue, GPU done seconds) marks on one
    clock, in issue order: per pass, each block's lag (seconds; a block met twice in a pass
    keeps the later); over the step, the median and the largest lag; per pass, its growth, the
    last block's lag less the first's. None without marks."""
    if not marks:
        return None
    lags = [done - issued for _, _, issued, done in marks]
    out: dict = {"median_seconds": statistics.median(lags), "max_seconds": max(lags)}
    for name in PASSES:
        mine = [(block, done - issued) for kind, block, issued, done in marks if kind == name]
        if mine:
            out[name] = {
                "per_block_seconds": {str(block): lag for block, lag in mine},
                "growth_seconds": mine[-1][1] - mine[0][1],
            }
    return out


def mean_of_steps(steps: list[dict | None]) -> dict | None:
    """Several steps' lag_stats as one (the bench's timed steps): every figure's mean."""
    steps = [s for s in steps if s]
    if not steps:
        return None
    out: dict = {k: statistics.mean(s[k] for s in steps) for k in ("median_seconds", "max_seconds")}
    for name in PASSES:
        have = [s[name] for s in steps if name in s]
        if not have:
            continue
        blocks = have[0]["per_block_seconds"]
        out[name] = {
            "per_block_seconds": {
                b: statistics.mean(h["per_block_seconds"].get(b, 0.0) for h in have) for b in blocks
            },
            "growth_seconds": statistics.mean(h["growth_seconds"] for h in have),
        }
    return out


class IssueLag:
    """One step's issue marks on CUDA (see the module docstring); nothing on a CPU."""

    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None):
        """`event`: makes the anchor's timing event (a test's HostEvent drives this path on a
        CPU); by default a CUDA event, on CUDA only."""
        self.cuda = device.type == "cuda" or event is not None
        self._new_event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._anchor: tuple[Any, float] | None = None
        self._marks: list[tuple[str, int, float, Any]] = []

    def anchor(self) -> None:
        """At the step's start, with the compute stream idle (the last step ended with a sync):
        the GPU's time zero on the host's clock."""
        self._marks.clear()
        if self.cuda:
            event = self._new_event()
            event.record()
            self._anchor = (event, _clock())

    def mark(self, kind: str, block: int, event: Any) -> None:
        """Block `block`'s work in pass `kind` is issued; `event`, just recorded after it, says
        when the GPU is done with it."""
        if self.cuda and self._anchor is not None:
            self._marks.append((kind, block, _clock(), event))

    def take(self) -> dict | None:
        """After the step's sync: lag_stats of its marks (None on a CPU), and a fresh start."""
        marks, self._marks = self._marks, []
        if self._anchor is None or not marks:
            return None
        zero, host_zero = self._anchor
        self._anchor = None
        return lag_stats(
            [(k, b, t, host_zero + zero.elapsed_time(e) / 1e3) for k, b, t, e in marks]
        )
