"""engine/issue_lag.py: how far the GPU's work on each block lags the host's issue of it, reduced
from (issue, done) timestamps; the event path driven on a CPU by the host-clock stand-in."""

from __future__ import annotations

import pytest
import torch

from appliance.bench.table import lag_line
from appliance.engine import device_weights, issue_lag
from appliance.engine.device_weights import HostEvent
from appliance.engine.issue_lag import IssueLag, lag_stats, mean_of_steps


def test_a_launch_bound_pass_keeps_its_lag_flat_and_a_gpu_bound_one_grows():
    # launch-bound: the GPU is done 1 ms after each block is issued, whatever the block
    flat = [("forward", i, 0.010 * i, 0.010 * i + 0.001) for i in range(4)]
    # GPU-bound: the host issues a block every 10 ms, the GPU takes 30 ms for each
    growing = [("backward", i, 0.010 * k, 0.030 * (k + 1)) for k, i in enumerate((3, 2, 1, 0))]
    s = lag_stats(flat + growing)
    assert s["forward"]["per_block_seconds"] == pytest.approx({str(i): 0.001 for i in range(4)})
    assert s["forward"]["growth_seconds"] == pytest.approx(0.0)
    # lags 0.030, 0.050, 0.070, 0.090 in issue order (blocks 3, 2, 1, 0)
    assert s["backward"]["per_block_seconds"] == pytest.approx(
        {"3": 0.03, "2": 0.05, "1": 0.07, "0": 0.09}
    )
    assert s["backward"]["growth_seconds"] == pytest.approx(0.06)
    assert s["max_seconds"] == pytest.approx(0.09)
    assert s["median_seconds"] == pytest.approx((0.001 + 0.03) / 2)
    assert lag_stats([]) is None
    line = lag_line(s)
    assert "through the forward +0.0 ms" in line and "through the backward +60.0 ms" in line


def test_steps_average_figure_by_figure():
    a = lag_stats([("forward", 0, 0.0, 0.002), ("forward", 1, 0.1, 0.104)])
    b = lag_stats([("forward", 0, 0.0, 0.004), ("forward", 1, 0.1, 0.108)])
    m = mean_of_steps([a, None, b])
    assert m["forward"]["per_block_seconds"] == pytest.approx({"0": 0.003, "1": 0.006})
    assert m["forward"]["growth_seconds"] == pytest.approx(0.003)
    assert m["max_seconds"] == pytest.approx(0.006) and "backward" not in m
    assert mean_of_steps([None, None]) is None


def test_the_event_path_puts_each_event_on_the_host_s_clock(monkeypatch):
    """IssueLag with HostEvent for CUDA's events and a clock that ticks 1 s a reading: the
    anchor's event at 0 s, read by the host at 1 s; each block's event recorded one tick before
    the host reads its clock, so every lag is host_zero + event − issue = 1 + t − (t + 1) = 0."""
    ticks = iter(range(100))
    clock = lambda: float(next(ticks))  # noqa: E731
    monkeypatch.setattr(device_weights, "_clock", clock)
    monkeypatch.setattr(issue_lag, "_clock", clock)
    lag = IssueLag(torch.device("cpu"), event=HostEvent)
    lag.anchor()
    for i in range(3):
        e = HostEvent()
        e.record()
        lag.mark("forward", i, e)
    s = lag.take()
    assert s["forward"]["per_block_seconds"] == {"0": 0.0, "1": 0.0, "2": 0.0}
    assert lag.take() is None  # taken: the next step starts afresh


def test_on_a_cpu_nothing_is_recorded():
    lag = IssueLag(torch.device("cpu"))
    lag.anchor()
    e = HostEvent()
    e.record()
    lag.mark("forward", 0, e)
    assert lag.take() is None
