"""benchmarks/gpu_proof.sh fits the device time a task is lent (15 minutes, a minute or more of
it the machine's start): its stages run here with a stand-in Python that only says what it was
asked to run, and their steps' worst cases (each time limit, plus the seconds `timeout` waits
after its SIGINT before it kills) are added up."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.sh"
DEVICE_SECONDS = 15 * 60  # a task's device time, every call, start and idle included
START_SECONDS = 60  # a machine's start: "a minute or more"; 30 s on 2026-11-27
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
    limits = {  # a step's worst case: its limit, then the wait for it to stop after SIGINT
        name: int(limit) + int(stop)
        for name, limit, stop in re.findall(
            r"^=== (\S+) \(limit (\d+) s, then (\d+) s to stop\)", done.stdout, re.M
        )
    }
    return done, limits


def test_the_next_sessions_two_calls_fit_its_device_time(tmp_path):
    first, first_limits = run_stage("block", tmp_path)
    second, second_limits = run_stage("tests", tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert list(first_limits) == [
        "appliance-7b-eager",
        "appliance-7b-compiled",
        "appliance-7b-x2",
        "appliance-7b-x4",
        "block-compile",
    ]
    assert list(second_limits) == ["pytest-gpu", "dequant"]
    header = SCRIPT.read_text()
    for stage, limits in (("block", first_limits), ("tests", second_limits)):
        (budget,) = re.findall(rf"gpu_proof\.sh {stage} +# ≤ (\d+) s", header)
        assert sum(limits.values()) <= int(budget), (stage, limits)
    spent = START_SECONDS + sum(first_limits.values()) + sum(second_limits.values())
    assert spent + 2 * CALL_EXTRA <= DEVICE_SECONDS, spent
    ran = first.stdout + second.stdout
    # the eager row beside the others, on the same machine and code
    assert re.search(r"--preset 7b --modes streamed --json \S+/appliance-7b-eager", ran)
    # the same 16384 tokens a step as the preset's 8 × 1 × 2048, in fewer, bigger micro-batches
    assert "--micro-batch-size 2 --micro-batches-per-step 4" in ran
    assert "--micro-batch-size 4 --micro-batches-per-step 2" in ran
    assert re.search(r"--preset 7b --modes streamed --compile-blocks --json", ran)
    assert "--profile" not in ran  # a profiled step takes far longer (the first session's lesson)
    assert (tmp_path / "block" / "block.log").is_file()
    # each step's log says how long it took
    assert re.search(r"^=== appliance-7b-eager took \d+ s$", first.stdout, re.M)


@pytest.mark.parametrize("stage", ["13b", "7b", "70b-nf4", "profile"])
def test_each_later_stage_fits_one_call(stage, tmp_path):
    done, limits = run_stage(stage, tmp_path)
    assert done.returncode == 0, done.stderr
    assert limits and sum(limits.values()) + CALL_EXTRA <= 600, limits  # the tool's call limit


def test_an_unknown_stage_is_refused(tmp_path):
    done, limits = run_stage("all", tmp_path)
    assert done.returncode == 2 and not limits
    assert "unknown stage all: 13b | block | tests | 7b | 70b-nf4 | profile" in done.stderr
