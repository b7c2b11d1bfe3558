"""End to end: a real Prometheus server scrapes a real `appliance train` run on embedded Ray, and
its HTTP API shows what the run's JSON log says: tokens rise, the trainer's phases add up to its
step time, the loss is the logged loss.

Needs the `prometheus` binary (`bash scripts/install-prometheus.sh`, which `make test` runs).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

try:
    import appliance.cli  # noqa: F401

    HAVE_CLI = True
except ImportError:
    HAVE_CLI = False

ROOT = Path(__file__).resolve().parents[1]
STEPS = 150  # about 0.1 s each for the demo model on a CPU: 15 s of steps, 1 s scrapes
SCRAPE_INTERVAL_S = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class PrometheusServer:
    def __init__(self, base: str):
        self.base = base

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query_range(self, expr: str, start: float, end: float) -> list[list[tuple[float, float]]]:
        """One list of (timestamp, value) per series, 1 s resolution."""
        qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1s"})
        body = http_json(f"{self.base}/api/v1/query_range?{qs}")
        assert body["status"] == "success", body
        return [[(float(t), float(v)) for t, v in s["values"]] for s in body["data"]["result"]]

    def series(self, expr: str, start: float, end: float) -> list[tuple[float, float]]:
        """The one series `expr` gives over [start, end]."""
        found = self.query_range(expr, start, end)
        assert len(found) == 1, (
            f"{expr}: {len(found)} series scraped (expected 1); does every actor record its "
            "metrics (appliance.metrics recorders)?"
        )
        return found[0]


@pytest.fixture
def prometheus(tmp_path) -> Iterator[tuple[PrometheusServer, int]]:
    """A Prometheus server scraping 127.0.0.1:<metrics port> every second; killed by PID."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `bash scripts/install-prometheus.sh`")
    metrics_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    interval = f"{SCRAPE_INTERVAL_S}s"
    scrape = {
        "job_name": "appliance",
        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
    }
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": interval, "scrape_timeout": interval},
                "scrape_configs": [scrape],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = PrometheusServer(f"http://127.0.0.1:{web_port}")
    try:
        deadline = time.monotonic() + 60
        while not server.ready():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.2)
        yield server, metrics_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.skipif(not HAVE_CLI, reason="appliance.cli cannot be imported yet (no train CLI)")
def test_prometheus_scrapes_a_training_run(prometheus, tmp_path):
    server, metrics_port = prometheus
    start = time.time()
    run = subprocess.run(
        [sys.executable, "-c", "from appliance.cli import main; main()", "train"]
        + ["--steps", str(STEPS), "--log-format", "json", "--metrics-port", str(metrics_port)]
        + ["--output", str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    end = time.time() + SCRAPE_INTERVAL_S
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"http://127.0.0.1:{metrics_port}/metrics" in run.stderr + run.stdout  # URL printed
    log = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    by_step = {r["step"]: r for r in log}
    tokens_after = [0]
    for r in log:
        tokens_after.append(tokens_after[-1] + r["tokens"])

    # tokens total rises, and every scraped value is the logged total after some step
    tokens = server.series("sum(ray_appliance_tokens_total)", start, end)
    values = [v for _, v in tokens]
    assert len(set(values)) >= 2, f"tokens total never rose across scrapes: {values}"
    assert values == sorted(values) and values[-1] > values[0]
    assert set(values) <= set(tokens_after), sorted(set(values) - set(tokens_after))

    # the trainer's named phases add up to its step time (counters from the same scrapes)
    named = 'sum(ray_appliance_phase_seconds_total{rank!="driver", phase!="other"})'
    phases = server.series(named, start, end)
    step_time = server.series("sum(ray_appliance_step_time_seconds_total)", start, end)
    common = sorted(set(dict(phases)) & set(dict(step_time)))
    assert common, "phase and step-time counters were never scraped together"
    last = common[-1]
    phase_sum, step_sum = dict(phases)[last], dict(step_time)[last]
    assert step_sum > 0 and math.isclose(phase_sum, step_sum, rel_tol=0.10), (phase_sum, step_sum)
    # ... and the step time is the logged step seconds summed up to some step
    sums = [0.0]
    for r in log:
        sums.append(sums[-1] + r["step_seconds"])
    assert any(math.isclose(step_sum, s, rel_tol=1e-6) for s in sums), step_sum

    # the loss Prometheus saw is the loss the driver logged, at the step it was scraped with
    loss = server.series("max(ray_appliance_loss)", start, end)
    step = server.series("max(ray_appliance_step)", start, end)
    logged = [r["loss"] for r in log]
    for _, value in loss:
        assert any(math.isclose(value, x, rel_tol=1e-9) for x in logged), value
    loss_at = dict(loss)
    paired = [(int(s), loss_at[t]) for t, s in step if t in loss_at]
    matched = [s for s, v in paired if math.isclose(v, by_step[s]["loss"], rel_tol=1e-9)]
    assert matched, f"no scrape paired a step with its logged loss: {paired[:5]}"

    # Ray's own node metrics came from the same endpoint
    assert server.query_range("max(ray_node_cpu_utilization)", start, end)
