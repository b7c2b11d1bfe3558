"""A graceful stop does not depend on stdout or stderr being alive (issue 44, item 0).

`appliance train … 2>&1 | tee train.log`, then Ctrl-C in that terminal: the signal kills `tee`
too, and the run's next write hits a dead pipe. Here the test is `tee`: it reads the run's
output through one pipe, closes it (tee dies), then sends SIGINT. The run must write its
checkpoint, record itself interrupted, go quiet and exit 130; a double Ctrl-C exits 130 too.

The two tests' runs are scenarios run side by side (tests/helpers_side.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.storage.checkpoints import load_latest_checkpoint
from tests.helpers_model import make_model
from tests.helpers_side import ran, selected_side_by_side
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

STEPS = 400  # far more than a test waits for: the run is stopped long before its end
FOUR_CPUS = {"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pipe")
    model = make_model(
        root / "model", "llama-mha", hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(300, seed=2)))
    return model, data


def argv(inputs, output: Path, *extra: str) -> list[str]:
    model, data = inputs
    return [
        *("train", "--model", str(model), "--data", str(data), "--output", str(output)),
        *("--steps", str(STEPS), "--seq-len", "32", "--micro-batch-size", "2"),
        *("--micro-batches-per-step", "2", "--lora-rank", "4", "--tokenize-workers", "1"),
        *("--log-format", "plain"),
        *extra,
    ]


def piped_into_tee(args: list[str]) -> subprocess.Popen:
    """`appliance <args> 2>&1 | tee`: stdout and stderr into one pipe that this test reads."""
    return subprocess.Popen(
        [sys.executable, "-m", "appliance", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **FOUR_CPUS},
    )


def read_until(p: subprocess.Popen, pattern: str) -> str:
    seen = b""
    for line in p.stdout:
        seen += line
        if re.search(pattern.encode(), line):
            return seen.decode(errors="replace")
    raise AssertionError(f"no line matching {pattern!r}: {seen.decode(errors='replace')[-3000:]}")


def tee_dies_then(p: subprocess.Popen, *signals: signal.Signals) -> int:
    """The terminal's Ctrl-C: tee goes first (its end of the pipe closes), then the run gets
    `signals`, one after the other. The run's exit status."""
    p.stdout.close()
    for sig in signals:
        p.send_signal(sig)
    try:
        return p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise


def record(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def scenario_ctrl_c(inputs, tmp_path: Path) -> None:
    out = tmp_path / "fresh"
    p = piped_into_tee(argv(inputs, out))
    read_until(p, rf"^step 10/{STEPS} ")
    assert tee_dies_then(p, signal.SIGINT) == 130
    step = load_latest_checkpoint(str(out)).step  # the steps are not lost
    assert 10 <= step < STEPS
    done = record(out)
    assert done["status"] == "interrupted" and done["steps"] == step

    # resumed the same way, and stopped before its first step: interrupted, not failed, and not
    # left `running`
    p = piped_into_tee(["train", "--output", str(out), "--resume", "--log-format", "plain"])
    read_until(p, "^resumed from step-")
    assert tee_dies_then(p, signal.SIGINT) == 130
    assert record(out)["status"] == "interrupted"
    assert "SystemError" not in json.dumps(record(out))
    assert load_latest_checkpoint(str(out)).step >= step


def scenario_double_ctrl_c(inputs, tmp_path: Path) -> None:
    out = tmp_path / "double"
    p = piped_into_tee(argv(inputs, out))
    read_until(p, rf"^step 10/{STEPS} ")
    assert tee_dies_then(p, signal.SIGINT, signal.SIGINT) == 130
    assert record(out)["status"] in ("interrupted", "running")  # stopped at once: no promise


SCENARIOS = {  # test -> its scenario, longest first (side_by_side)
    "test_ctrl_c_with_a_dead_pipe_checkpoints_and_exits_130": scenario_ctrl_c,
    "test_a_double_ctrl_c_with_a_dead_pipe_exits_130": scenario_double_ctrl_c,
}


@pytest.fixture(scope="module")
def scenarios(request, inputs, tmp_path_factory):
    with selected_side_by_side(request, tmp_path_factory, SCENARIOS, inputs) as futures:
        yield futures


def test_ctrl_c_with_a_dead_pipe_checkpoints_and_exits_130(scenarios):
    ran(scenarios, "test_ctrl_c_with_a_dead_pipe_checkpoints_and_exits_130")


def test_a_double_ctrl_c_with_a_dead_pipe_exits_130(scenarios):
    ran(scenarios, "test_a_double_ctrl_c_with_a_dead_pipe_exits_130")
