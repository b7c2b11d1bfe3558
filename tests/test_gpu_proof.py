"""benchmarks/gpu_proof.sh fits the device time a task is lent (15 minutes, a minute or more of
it the machine's start): its stages run here with a stand-in Python that only says what it was
asked to run, and their steps' time limits are added up."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.sh"
DEVICE_SECONDS = 15 * 60  # a task's device time, every call, start and idle included
START_SECONDS = 120  # a machine's start: "a minute or more"
CALL_EXTRA = 60  # each call beyond its steps: the tree's transfer, nvidia-smi, the C build


def run_stage(stage: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """The stage run with PROOF_PYTHON a script that echoes its arguments; its steps' limits."""
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\necho "ran: $*"\n')
    stand_in.chmod(0o755)
    out = tmp_path / stage
    env = {**os.environ, "PROOF_PYTHON": str(stand_in), "OUT": str(out)}
    done = subprocess.run(
        ["bash", str(SCRIPT), stage], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    limits = {
        name: int(limit)
        for name, limit in re.findall(r"^=== (\S+) \(limit (\d+) s\)", done.stdout, re.M)
    }
    return done, limits


def test_the_first_sessions_two_calls_fit_its_device_time(tmp_path):
    core, core_limits = run_stage("core", tmp_path)
    more, more_limits = run_stage("more", tmp_path)
    assert core.returncode == more.returncode == 0, core.stderr + more.stderr
    assert list(core_limits) == ["pytest-gpu", "dequant", "appliance-7b", "hf-7b"]
    assert list(more_limits) == ["fsdp2-7b", "appliance-70b-nf4"]
    header = SCRIPT.read_text()
    for stage, limits in (("core", core_limits), ("more", more_limits)):
        (budget,) = re.findall(rf"gpu_proof\.sh {stage} +# ≤ (\d+) s", header)
        assert sum(limits.values()) <= int(budget), (stage, limits)
    spent = START_SECONDS + sum(core_limits.values()) + sum(more_limits.values()) + 2 * CALL_EXTRA
    assert spent <= DEVICE_SECONDS, spent
    # every step of both ran, with what the proof needs of it
    ran = core.stdout + more.stdout
    assert "ran: -m pytest -m gpu" in ran
    assert re.search(r"ran: -m appliance.bench --preset 7b --profile --json \S+/appliance-7b", ran)
    assert re.search(r"--preset 70b --base-quant nf4 --gpu-memory-budget 24GiB --steps 1 ", ran)
    assert "benchmarks.compare" not in more.stdout  # made on the CPU from both calls' JSON
    assert (tmp_path / "core" / "core.log").is_file()


def test_the_first_sessions_second_call_fits_what_core_left(tmp_path):
    """`core` ran (2026-11-27: 343 s of the 900, start included); `rest` then had 552 s."""
    rest, limits = run_stage("rest", tmp_path)
    assert rest.returncode == 0, rest.stderr
    (budget,) = re.findall(r"gpu_proof\.sh rest +# ≤ (\d+) s", SCRIPT.read_text())
    assert sum(limits.values()) <= int(budget) and int(budget) + CALL_EXTRA <= 552 - 30
    assert re.search(r"ran: -m appliance.bench --preset 7b +--json \S+/appliance-7b", rest.stdout)


@pytest.mark.parametrize("stage", ["block", "13b", "tests", "7b", "70b-nf4"])
def test_each_later_stage_fits_one_call(stage, tmp_path):
    done, limits = run_stage(stage, tmp_path)
    assert done.returncode == 0, done.stderr
    assert limits and sum(limits.values()) + CALL_EXTRA <= 600, limits  # the tool's call limit


def test_an_unknown_stage_is_refused(tmp_path):
    done, limits = run_stage("all", tmp_path)
    assert done.returncode == 2 and not limits
    assert (
        "unknown stage all: core | more | rest | block | 13b | tests | 7b | 70b-nf4" in done.stderr
    )
