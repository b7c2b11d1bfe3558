"""The metrics endpoint listens on loopback by default; `--metrics-host 0.0.0.0` widens it (issue
44, item 10). It bound 0.0.0.0 with no way to choose, and its labels carry --output paths and
bucket names. What the kernel says the run's process listens on is the proof (/proc/net/tcp).

The two cases' runs go side by side (tests/helpers_side.py), each on its own port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from tests.helpers_model import make_model
from tests.helpers_net import free_port
from tests.helpers_side import ran, side_by_side
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration


def listening(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on at `port` (/proc/net/tcp: LISTEN is state 0A)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, at = local.split(":")
        if state == "0A" and int(at, 16) == port:
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mh")
    model = make_model(root / "model", "llama-mha")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(100)))
    return model, data


def scenario_listens(inputs, tmp_path: Path, host: str | None, bound: str) -> None:
    model, data = inputs
    port = free_port()
    extra = ["--metrics-host", host] if host else []
    p = subprocess.Popen(
        [sys.executable, "-m", "appliance", "train", "--model", str(model), "--data", str(data),
         "--output", str(tmp_path / "o"), "--steps", "2000", "--seq-len", "16",
         "--micro-batch-size", "2", "--tokenize-workers", "1", "--metrics-port", str(port),
         "--log-format", "plain", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})},
    )  # fmt: skip
    try:
        seen = ""
        for line in p.stdout:
            seen += line
            if re.match(r"^step \d+/2000 ", line):
                break
        assert f"metrics: http://127.0.0.1:{port}/metrics" in seen, seen[-3000:]
        assert listening(port) == {bound}, (listening(port), seen[-2000:])
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise


CASES = {"default": (None, "127.0.0.1"), "every-interface": ("0.0.0.0", "0.0.0.0")}


@pytest.fixture(scope="module")
def scenarios(inputs, tmp_path_factory):
    with side_by_side(
        {
            case: partial(scenario_listens, inputs, tmp_path_factory.mktemp(case), host, bound)
            for case, (host, bound) in CASES.items()
        }
    ) as futures:
        yield futures


@pytest.mark.parametrize("case", CASES)
def test_the_metrics_endpoint_listens_where_metrics_host_says(scenarios, case):
    ran(scenarios, case)
