"""End to end: a real Prometheus server scrapes a real `appliance train` run on embedded Ray, and
its HTTP API shows what the run's JSON log says: tokens rise, the trainer's phases add up to its
step time, the loss is the logged loss. A tokenizer worker is killed mid-run, so the restart
counter is real too; afterwards every `ray_appliance_*` selector the dashboards use matches series
in Prometheus, except the GPU-only ones (tests/metrics/test_dashboards.py, APPLIANCE_GPU_ONLY_SERIES,
each with its reason): a declared metric that no real code records fails here.

Needs the `prometheus` binary (`bash scripts/install-prometheus.sh`, which `make test` runs);
skipped without it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from appliance.config import DEMO_SETTINGS
from appliance.run.demo import make_demo
from tests.helpers_net import free_port
from tests.metrics.test_dashboards import ALL_EXPRESSIONS, appliance_selectors, gpu_only, substitute

pytestmark = pytest.mark.integration

try:
    import appliance.cli.main  # noqa: F401

    HAVE_CLI = True
except ImportError:
    HAVE_CLI = False

ROOT = Path(__file__).resolve().parents[2]
STEPS = 150  # about 0.1 s each for the demo model on a CPU: 15 s of steps, 1 s scrapes
KILL_AT_STEP = 20  # a tokenizer worker is SIGKILLed once this step is logged
CHECKPOINT_EVERY = 50  # mid-run checkpoints: the driver's checkpoint metrics are scraped
BAD_RECORDS = 5  # in the first 500 records: the tokenizer error counter is real too
SCRAPE_INTERVAL_S = 1
RUN_TIMEOUT_S = 600


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

    def matching_series(self, selector: str, start: float, end: float) -> list[dict]:
        """The label sets of every series `selector` matched at some time in [start, end]."""
        qs = urllib.parse.urlencode({"match[]": selector, "start": start, "end": end})
        body = http_json(f"{self.base}/api/v1/series?{qs}")
        assert body["status"] == "success", body
        return body["data"]

    def series(self, expr: str, start: float, end: float) -> list[tuple[float, float]]:
        """The one series `expr` gives over [start, end]."""
        found = self.query_range(expr, start, end)
        assert len(found) == 1, (
            f"{expr}: {len(found)} series scraped (expected 1); does every actor record its "
            "metrics (appliance.metrics.recorders recorders)?"
        )
        return found[0]


@pytest.fixture
def prometheus(tmp_path) -> Iterator[tuple[PrometheusServer, int]]:
    """A Prometheus server scraping 127.0.0.1:<metrics port> every second; killed by PID."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed: run `bash scripts/install-prometheus.sh`")
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


def demo_inputs_with_bad_records(root: Path) -> list[str]:
    """The built-in demo's model and corpus, with BAD_RECORDS malformed records spread over the
    corpus's start; the flags to train on them with the demo's own settings."""
    made = make_demo(root / "demo")
    corpus = Path(made["data"])
    lines = corpus.read_text().splitlines(keepends=True)
    for i in range(BAD_RECORDS):
        lines.insert(100 * i + 50, "{not json\n" if i % 2 else '{"title": "no text"}\n')
    corpus.write_text("".join(lines))
    settings = {k: v for k, v in DEMO_SETTINGS.items() if k != "steps"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    # validation on 2% of the documents held out, every 50 steps: the eval-loss panel's series
    validation = ["--eval-split", "0.02", "--eval-every", "50"]
    return [
        *("--model", made["model"], "--data", str(corpus), "--on-bad-record", "skip"),
        *validation,
        *flags,
    ]


def kill_a_tokenizer_worker(driver_pid: int) -> None:
    """SIGKILL one tokenizer worker (a Ray actor process under the driver this test started)."""
    for child in psutil.Process(driver_pid).children(recursive=True):
        try:
            if "ray::ShardWorker" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGKILL)
                return
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no ray::ShardWorker process under the driver")


def train_killing_a_worker(argv: list[str], cwd: Path) -> tuple[int, list[str], str]:
    """Run `argv`, kill a tokenizer worker once step KILL_AT_STEP is logged; (rc, stdout lines,
    stderr). stderr goes to a file so a chatty run cannot block on a full pipe."""
    err_path = cwd / "train.stderr"
    with err_path.open("w") as err:
        # the run's last numbers reach the endpoint before it ends: the wait tests/conftest.py
        # turns off for the suite's other runs
        env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_LAST_METRICS_WAIT_MS"}
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        # a hung run is killed (its session: the driver this test started, and its children)
        watchdog = threading.Timer(RUN_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
        watchdog.start()
        lines: list[str] = []
        killed = False
        try:
            for line in proc.stdout:
                lines.append(line)
                if not killed and line.startswith('{"step"'):
                    if json.loads(line)["step"] >= KILL_AT_STEP:
                        kill_a_tokenizer_worker(proc.pid)
                        killed = True
            rc = proc.wait(timeout=60)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert killed, f"the run ended before step {KILL_AT_STEP}: {err_path.read_text()[-3000:]}"
    return rc, lines, err_path.read_text()


@pytest.mark.skipif(not HAVE_CLI, reason="appliance.cli.main cannot be imported yet (no train CLI)")
def test_prometheus_scrapes_a_training_run_and_sees_every_dashboard_series(prometheus, tmp_path):
    server, metrics_port = prometheus
    start = time.time()
    rc, stdout, stderr = train_killing_a_worker(
        [sys.executable, "-c", "from appliance.__main__ import entry; entry()", "train"]
        + ["--steps", str(STEPS), "--log-format", "json", "--metrics-port", str(metrics_port)]
        + ["--output", str(tmp_path / "out"), "--checkpoint-every", str(CHECKPOINT_EVERY)]
        + demo_inputs_with_bad_records(tmp_path),
        cwd=tmp_path,
    )
    time.sleep(2 * SCRAPE_INTERVAL_S)  # the last scrape of the run's final numbers lands
    end = time.time()
    assert rc == 0, stderr[-3000:]
    assert "tokenizer failed" in stderr  # the kill landed mid-run, and the run recovered
    assert f"http://127.0.0.1:{metrics_port}/metrics" in stderr + "".join(stdout)  # URL printed
    log = [json.loads(line) for line in stdout if line.startswith('{"step"')]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert [r["step"] for r in log if "eval_loss" in r] == [50, 100, 150]
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

    # the driver counted the restart it made, and the workers the bad records they skipped
    restarts = server.series('max(ray_appliance_restarts_total{kind="tokenizer"})', start, end)
    assert restarts[-1][1] == 1, restarts[-5:]
    errors = server.series("sum(ray_appliance_tokenizer_errors_total)", start, end)
    assert 1 <= errors[-1][1] <= BAD_RECORDS * 2, errors[-5:]  # a re-read after the kill counts

    # every appliance selector the dashboards use matched series this real run produced
    used: dict[str, set[str]] = {}
    for dashboard, expr in ALL_EXPRESSIONS:
        for selector in appliance_selectors(substitute(expr)):
            used.setdefault(selector, set()).add(dashboard)
    assert len(used) > 10
    dead = {
        selector: sorted(dashboards)
        for selector, dashboards in sorted(used.items())
        if not gpu_only(selector) and not server.matching_series(selector, start, end)
    }
    assert not dead, (
        "dashboards select series a real CPU run never recorded (a metric no code records, or "
        f"a GPU-only one missing from APPLIANCE_GPU_ONLY_SERIES): {dead}"
    )
