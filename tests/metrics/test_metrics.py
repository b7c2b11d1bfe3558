"""Metrics: the registry, docs/metrics.md kept equal to it, recorders that cost nothing without
Ray, the NVML sampler, and a real scrape of embedded Ray's metrics endpoint."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.errors import ConfigError
from appliance.hardware.gpu_monitor import NvmlSampler
from appliance.hardware.gpus import peak_flops_per_second
from appliance.metrics import endpoint
from appliance.metrics import names as N
from appliance.metrics import recorders as M
from tests.helpers_net import free_port
from tests.helpers_ray import ray_session

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "metrics.md"

# ---------------------------------------------------------------------- shared with test_dashboards


@contextlib.contextmanager
def embedded_ray() -> Iterator[int]:
    """Embedded Ray with its metrics endpoint on a free port, started as the driver does."""
    import ray

    if ray.is_initialized():  # a leftover session would serve its metrics on another port
        ray.shutdown()
    port = free_port()
    with ray_session(
        num_cpus=2, include_dashboard=False, log_to_driver=False, **endpoint.ray_init_kwargs(port)
    ):
        yield port


def full_trainer_stats(step: int = 1) -> dict[str, Any]:
    """Stats with every key TrainerMetrics.record_step reads, GPU ones included."""
    return {
        "step": step,
        "loss": 2.5,
        "lr": 3e-4,
        "tokens": 4096,
        "step_seconds": 2.0,
        "phase_seconds": {
            "forward": 0.6,
            "backward": 0.8,
            "optimizer": 0.1,
            "data_wait": 0.2,
            "h2d_stall": 0.1,
            "h2d_host": 0.02,
            "checkpoint": 0.05,
        },
        "h2d_bytes": 1 << 30,
        "h2d_seconds": 0.5,
        "dequant_seconds": 0.03,
        "expert_share": 0.4,  # a MoE model streamed by expert
        "flops": 1.5e12,
        "mfu": None,  # derived from flops / step_seconds / peak_flops
        "gpu_busy_ratio": 0.8,
        "issue_lag": {"median_seconds": 0.004, "max_seconds": 0.02},  # engine/issue_lag.py
        "nvml_util_mean": 0.9,
        "gpu_mem_allocated": 10 << 30,
        "gpu_mem_reserved": 12 << 30,
        "loss_scale": 32768.0,  # float16 compute
        "skipped_step": True,
        "d2h_bytes": 1 << 28,  # full fine-tuning: the weight gradients to the host
        "optimizer_host_seconds": 0.4,  # full fine-tuning: AdamW on the host
        "grad_norm": 0.7,  # not a metric: ignored
    }


class RecordEverything:
    """A Ray actor body that records every appliance metric once, as the actors will."""

    def record(self) -> None:
        M.TrainerMetrics(rank=0, peak_flops=1e12).record_step(full_trainer_stats())
        tok = M.TokenizerMetrics(worker=1)
        tok.record_totals(1000, 10, 1, 0.25)
        tok.record_totals(1500, 12, 1, 0.5)
        driver = M.DriverMetrics()
        driver.batches_in_flight(4)
        driver.queue_depth(worker=1, n=3)
        driver.queue_depth(worker=1, n=2)
        driver.restart("trainer")
        driver.checkpoint_seconds(1.5)
        driver.eval_loss(2.5)
        driver.target_share(0.9)
        M.WeightStoreMetrics().record(123456789)


def scrape(port: int) -> str:
    with urllib.request.urlopen(endpoint.metrics_url(port), timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def scrape_until(port: int, names: set[str], deadline_s: float = 60.0) -> str:
    """Scrape until every sample name in `names` appears (Ray's agent reports each second)."""
    deadline = time.monotonic() + deadline_s
    missing = names
    while time.monotonic() < deadline:
        try:
            text = scrape(port)
        except OSError:  # the agent's endpoint comes up a moment after ray.init
            text = ""
        missing = names - {name for name, _, _ in samples(text)}
        if not missing:
            return text
        time.sleep(0.5)
    raise AssertionError(f"not served within {deadline_s:.0f} s: {sorted(missing)}")


ALL_SAMPLE_NAMES = {name for spec in N.REGISTRY for name in spec.sample_names}


def record_everything_and_scrape(port: int) -> str:
    import ray

    actor = ray.remote(num_cpus=0)(RecordEverything).remote()
    ray.get(actor.record.remote())
    return scrape_until(port, ALL_SAMPLE_NAMES)


# ---------------------------------------------------------------------- the registry


def test_registry_names_are_unique_prefixed_and_carry_units():
    names = [s.name for s in N.REGISTRY]
    assert len(names) == len(set(names))
    for spec in N.REGISTRY:
        assert spec.name.startswith("appliance_") and spec.unit and spec.description
        for name in (spec.name, *spec.tag_keys):
            assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        if spec.unit in ("seconds", "bytes", "ratio"):
            assert spec.name.endswith("_" + spec.unit), f"{spec.name} should end in _{spec.unit}"
    # every module-level MetricSpec constant is registered
    constants = [v for v in vars(M).values() if isinstance(v, N.MetricSpec)]
    assert sorted(s.name for s in constants) == sorted(names)


def test_registry_has_what_the_dashboards_and_issue_need():
    prom = {s.prometheus_name: s for s in N.REGISTRY}
    for name in [
        "ray_appliance_tokens_total",
        "ray_appliance_steps_total",
        "ray_appliance_step_time_seconds_total",
        "ray_appliance_h2d_bytes_total",
        "ray_appliance_h2d_seconds_total",
        "ray_appliance_loss",
        "ray_appliance_learning_rate",
        "ray_appliance_mfu_ratio",
        "ray_appliance_gpu_busy_ratio",
        "ray_appliance_gpu_nvml_utilization_ratio",
        "ray_appliance_gpu_memory_allocated_bytes",
        "ray_appliance_gpu_memory_reserved_bytes",
        "ray_appliance_tokenizer_tokens_total",
        "ray_appliance_tokenizer_documents_total",
        "ray_appliance_tokenizer_errors_total",
        "ray_appliance_tokenizer_queue_depth",
        "ray_appliance_batches_in_flight",
        "ray_appliance_weight_store_bytes",
        "ray_appliance_restarts_total",
    ]:
        assert name in prom, name
    assert N.STEP_SECONDS.kind == N.HISTOGRAM
    assert N.STEP_SECONDS.sample_names[0] == "ray_appliance_step_seconds_bucket"
    # totals that must add up are counters (Ray approximates a histogram's _sum)
    assert N.PHASE_SECONDS.kind == N.STEP_TIME_SECONDS.kind == N.COUNTER
    assert N.PHASE_SECONDS.tag_keys == ("rank", "phase")
    assert {"forward", "backward", "optimizer", "data_wait", "h2d_stall", "checkpoint"} < set(
        N.PHASES
    )


def test_metric_spec_rejects_bad_declarations():
    with pytest.raises(ValueError, match="must start with"):
        N.MetricSpec("tokens", N.COUNTER, "tokens", "x")
    with pytest.raises(ValueError, match="adds `_total`"):
        N.MetricSpec("appliance_x_total", N.COUNTER, "x", "x")
    with pytest.raises(ValueError, match="boundaries"):
        N.MetricSpec("appliance_x_seconds", N.HISTOGRAM, "seconds", "x")


def _table_rows(markdown: str) -> list[list[str]]:
    """Cells of the rows of the metrics table (`|`-separated, `\\|` kept inside a cell)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| `ray_appliance_"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def test_docs_table_equals_the_registry():
    rows = _table_rows(DOCS.read_text())
    documented = {row[0].strip("`"): row for row in rows}
    assert len(documented) == len(rows), "a metric is listed twice in docs/metrics.md"
    expected = {s.prometheus_name: s for s in N.REGISTRY}
    assert set(documented) == set(expected), (
        f"docs/metrics.md lists {sorted(set(documented) - set(expected))} that the code lacks "
        f"and lacks {sorted(set(expected) - set(documented))}; regenerate the table with "
        "`python -m appliance.metrics`"
    )
    for name, spec in expected.items():
        _, kind, unit, labels, meaning = documented[name]
        assert kind == spec.kind, name
        assert unit == spec.unit, name
        assert labels == (", ".join(f"`{k}`" for k in spec.tag_keys) or "-"), name
        assert meaning == spec.description, name
    assert N.markdown_table() in DOCS.read_text(), "rows out of order: regenerate the table"


# ---------------------------------------------------------------------- recorders without Ray


def test_recorders_never_import_ray_and_do_nothing_without_it():
    """In a fresh process: recording everything neither imports Ray nor creates metrics."""
    code = """
import sys
from appliance.metrics import recorders as M
from appliance.errors import ConfigError
from tests.metrics.test_metrics import RecordEverything
RecordEverything().record()
assert "ray" not in sys.modules, "recording imported ray"
assert not M._objects, M._objects
import ray  # imported but not initialized: still a no-op
RecordEverything().record()
assert not ray.is_initialized() and not M._objects, M._objects
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_unknown_phase_and_restart_kind_are_refused_even_without_ray():
    stats = full_trainer_stats()
    stats["phase_seconds"] = {"forwrad": 1.0}
    with pytest.raises(ValueError, match="forwrad"):
        M.TrainerMetrics().record_step(stats)
    with pytest.raises(ValueError, match="expected one of"):
        M.DriverMetrics().restart("gpu")


class FakeMetric:
    def __init__(self, spec: N.MetricSpec, log: list):
        self.spec, self.log = spec, log

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.log.append((self.spec.name, "inc", value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.log.append((self.spec.name, "set", value, tags))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.log.append((self.spec.name, "observe", value, tags))


@pytest.fixture
def fake_ray(monkeypatch) -> list:
    """Recorders think Ray is up and write to a list instead of ray.util.metrics."""
    log: list = []
    monkeypatch.setattr(M, "ray_metrics_enabled", lambda: True)
    monkeypatch.setattr(M, "_ray_metric", lambda spec: FakeMetric(spec, log))
    # each set once in the log (the refresher's sets again are the real-Ray test's to see)
    monkeypatch.setattr(M, "_set_gauge", lambda metric, name, value, tags: metric.set(value, tags))
    return log


def test_trainer_record_step(fake_ray):
    M.TrainerMetrics(rank=0, peak_flops=1e12).record_step(full_trainer_stats(step=7))
    got = {(n, t.get("phase")): (op, v, t) for n, op, v, t in fake_ray}
    assert got[("appliance_tokens", None)] == ("inc", 4096.0, {"rank": "0"})
    assert got[("appliance_steps", None)][1] == 1.0
    assert got[("appliance_step", None)][1] == 7.0
    assert got[("appliance_step_seconds", None)][:2] == ("observe", 2.0)
    assert got[("appliance_step_time_seconds", None)][:2] == ("inc", 2.0)
    phases = {p: v for (n, p), (_, v, _) in got.items() if n == "appliance_phase_seconds"}
    assert phases["forward"] == 0.6 and phases["checkpoint"] == 0.05
    assert phases["other"] == pytest.approx(2.0 - 1.87)  # what no phase claimed
    assert sum(phases.values()) == pytest.approx(2.0)
    assert got[("appliance_mfu_ratio", None)][1] == pytest.approx(1.5e12 / 2.0 / 1e12)
    assert got[("appliance_gpu_nvml_utilization_ratio", None)][1] == 0.9
    assert got[("appliance_gpu_issue_lag_seconds", None)][1] == 0.004  # the median
    assert got[("appliance_learning_rate", None)][1] == 3e-4
    assert got[("appliance_dequant_seconds", None)][:2] == ("inc", 0.03)
    assert got[("appliance_expert_share_ratio", None)][1] == 0.4


def test_trainer_record_step_on_cpu_leaves_gpu_metrics_absent(fake_ray):
    stats = {"loss": 3.0, "tokens": 64, "step_seconds": 0.5, "lr": 1e-3, "gpu_busy_ratio": None}
    stats["phase_seconds"] = {"forward": 0.2, "backward": 0.3, "h2d_stall": 0.0}
    M.TrainerMetrics(rank=0).record_step(stats)
    names = {n for n, *_ in fake_ray}
    assert not names & {
        "appliance_mfu_ratio",
        "appliance_gpu_busy_ratio",
        "appliance_gpu_issue_lag_seconds",
        "appliance_gpu_nvml_utilization_ratio",
        "appliance_gpu_memory_allocated_bytes",
        "appliance_h2d_bytes",
        "appliance_expert_share_ratio",  # a dense model
    }
    phases = {t["phase"] for n, _, _, t in fake_ray if n == "appliance_phase_seconds"}
    assert phases == {"forward", "backward"}  # zero seconds: nothing to add to a counter


def test_tokenizer_record_totals_adds_increments(fake_ray):
    tok = M.TokenizerMetrics(worker=2)
    tok.record_totals(100, 3, 0, 0.5)
    tok.record_totals(250, 5, 1, 0.75)
    incs = [(n, v) for n, op, v, t in fake_ray if op == "inc"]
    assert sum(v for n, v in incs if n == "appliance_tokenizer_tokens") == 250
    assert sum(v for n, v in incs if n == "appliance_tokenizer_documents") == 5
    assert sum(v for n, v in incs if n == "appliance_tokenizer_errors") == 1
    assert all(t == {"worker": "2"} for *_, t in fake_ray)


def test_driver_records_queue_depth_per_tokenizer_worker(fake_ray):
    driver = M.DriverMetrics()
    driver.queue_depth(worker=0, n=3)
    driver.queue_depth(worker=1, n=0)  # a drained worker reads 0, not "no data"
    assert fake_ray == [
        ("appliance_tokenizer_queue_depth", "set", 3.0, {"worker": "0"}),
        ("appliance_tokenizer_queue_depth", "set", 0.0, {"worker": "1"}),
    ]


def test_driver_checkpoint_goes_to_phase_checkpoint_rank_driver(fake_ray):
    M.DriverMetrics().checkpoint_seconds(1.25)
    assert ("appliance_phase_seconds", "inc", 1.25, {"rank": "driver", "phase": "checkpoint"}) in (
        fake_ray
    )
    assert ("appliance_checkpoints", "inc", 1.0, {}) in fake_ray


def test_ray_init_kwargs_and_url():
    port = free_port()
    kw = endpoint.ray_init_kwargs(port)
    assert kw["_metrics_export_port"] == port
    assert kw["_system_config"]["metrics_report_interval_ms"] == 1000
    assert endpoint.metrics_url(8080) == "http://127.0.0.1:8080/metrics"
    with pytest.raises(ConfigError, match="--metrics-port must be a TCP port"):
        endpoint.ray_init_kwargs(0)


def test_ray_init_kwargs_refuses_a_port_in_use():
    """Ray itself would time out after ~30 s with a message that does not name the port."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port} is already in use"):
            endpoint.ray_init_kwargs(port)


def test_ray_init_accepts_the_kwargs_by_name():
    """The private kwargs exist in the installed Ray (they are popped from **kwargs by name)."""
    import inspect

    import ray._private.worker as worker

    source = inspect.getsource(worker.init)
    for key in endpoint.ray_init_kwargs(free_port()):
        assert f'kwargs.pop("{key}"' in source, key


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("cpu", None),
        (None, None),
    ],
)
def test_peak_flops_per_second(name, peak):
    assert peak_flops_per_second(name) == peak


# ---------------------------------------------------------------------- the NVML sampler


def _wait_for(predicate, deadline_s: float = 60.0) -> None:  # (generous: a loaded CI box)
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_nvml_sampler_means_per_step_as_a_ratio():
    value = [50.0]
    sampler = NvmlSampler(lambda: value[0], hz=100)
    with sampler:
        _wait_for(lambda: sampler.samples_pending >= 3)
        assert sampler.take_mean() == pytest.approx(0.5)
        value[0] = 100.0
        sampler.take_mean()  # drop samples straddling the change
        _wait_for(lambda: sampler.samples_pending >= 3)
        assert sampler.take_mean() == pytest.approx(1.0)
    assert sampler._thread is None
    sampler.take_mean()
    assert sampler.take_mean() is None  # stopped: no new samples


def test_nvml_sampler_survives_read_errors():
    calls = []

    def read() -> float:
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return 30.0

    with NvmlSampler(read, hz=100) as sampler:
        _wait_for(lambda: sampler.errors >= 2 and sampler.samples_pending >= 2)
        assert sampler.take_mean() == pytest.approx(0.3)


def test_nvml_sampler_refuses_slow_rates():
    with pytest.raises(ValueError, match=">= 10 Hz"):
        NvmlSampler(lambda: 0.0, hz=5)


def test_nvml_sampler_absent_without_an_nvidia_driver():
    has_driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    sampler = NvmlSampler.for_cuda_device(0)
    assert (sampler is not None) == has_driver


@pytest.mark.gpu
def test_nvml_sampler_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    sampler = NvmlSampler.for_cuda_device(torch.cuda.current_device())
    assert sampler is not None
    with sampler:
        a = torch.randn(4096, 4096, device="cuda")
        _wait_for(lambda: sampler.samples_pending >= 5)
        sampler.take_mean()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # keep the GPU busy while sampling
            a = (a @ a).tanh_()
        torch.cuda.synchronize()
        mean = sampler.take_mean()
    assert mean is not None and 0.5 < mean <= 1.0


# ---------------------------------------------------------------------- a real scrape


@pytest.fixture(scope="module")
def ray_metrics_port() -> Iterator[int]:
    with embedded_ray() as port:
        yield port


@pytest.fixture(scope="module")
def recorded(ray_metrics_port) -> str:
    """The scrape after an actor recorded every appliance metric once."""
    return record_everything_and_scrape(ray_metrics_port)


@pytest.mark.integration
def test_a_gauge_set_in_an_earlier_ray_session_is_not_set_into_the_next(request):
    """The gauge refresher sets each gauge again to its last value; in a process that starts Ray
    again (the test process does) it set an earlier session's into the new one, where it showed
    as a second series beside the new run's (a stale queue depth of 0 beside the real 2)."""
    with embedded_ray():
        M.DriverMetrics().queue_depth(worker=9, n=5)
    port = request.getfixturevalue("ray_metrics_port")  # a new session (this module's)
    M.DriverMetrics().batches_in_flight(1)
    scrape_until(port, {"ray_appliance_batches_in_flight"})
    time.sleep(3)  # several refresher rounds and agent reports
    assert 'worker="9"' not in scrape(port)


@pytest.mark.integration
def test_the_embedded_rays_gcs_keeps_a_bounded_number_of_task_events(ray_metrics_port):
    """The embedded Ray's GCS keeps a bounded number of task events (issue 44, item 14): the
    soak benchmark (benchmarks/soak.py, docs/benchmarks.md "Soak") found its memory growing
    ~11 KiB a step, the event records of every task, which Ray keeps up to 100,000 of by
    default. Read in this process, which started Ray with the driver's `ray_init_kwargs` (it
    was tests/e2e/test_gcs_task_events_bound.py, which started a Ray in a child for it). After
    test_a_gauge_set_in_an_earlier_ray_session_is_not_set_into_the_next, which starts this
    module's session itself."""
    from ray._raylet import Config

    kept = Config.task_events_max_num_task_in_gcs()
    assert kept == endpoint.TASK_EVENTS_KEPT and kept < 100_000  # Ray's own default


@pytest.mark.integration
def test_actor_metrics_reach_rays_prometheus_endpoint(ray_metrics_port, recorded):
    got = samples(recorded)

    def value(name: str, **labels: str) -> float:
        found = [v for n, lb, v in got if n == name and labels.items() <= lb.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    assert value("ray_appliance_tokens_total", rank="0") == 4096
    assert value("ray_appliance_steps_total", rank="0") == 1
    assert value("ray_appliance_loss", rank="0") == 2.5
    assert value("ray_appliance_step_seconds_count", rank="0") == 1
    assert value("ray_appliance_phase_seconds_total", rank="0", phase="forward") == 0.6
    phases = sum(
        v for n, lb, v in got if n == "ray_appliance_phase_seconds_total" and lb["rank"] == "0"
    )
    assert phases == pytest.approx(value("ray_appliance_step_time_seconds_total", rank="0"))
    assert value("ray_appliance_phase_seconds_total", rank="driver", phase="checkpoint") == 1.5
    assert value("ray_appliance_mfu_ratio") == pytest.approx(0.75)
    assert value("ray_appliance_tokenizer_tokens_total", worker="1") == 1500
    assert value("ray_appliance_tokenizer_queue_depth", worker="1") == 2
    assert value("ray_appliance_restarts_total", kind="trainer") == 1
    assert value("ray_appliance_weight_store_bytes") == 123456789
    # Ray's own node metrics are served by the same endpoint
    assert {"ray_node_cpu_utilization", "ray_object_store_memory"} <= {n for n, _, _ in got}
    # the driver process records too (DriverMetrics lives there)
    M.DriverMetrics().restart("tokenizer")
    deadline = time.monotonic() + 30
    while 'kind="tokenizer"' not in scrape(ray_metrics_port):
        assert time.monotonic() < deadline, "the driver's restart never reached the endpoint"
        time.sleep(0.5)


class RecordGaugesOnce:
    """An actor that sets every gauge it sets once and then lives on, as a weight store does."""

    def record(self) -> None:
        M.TrainerMetrics(rank=0, peak_flops=1e12).record_step(full_trainer_stats())
        M.WeightStoreMetrics().record(987654321)


SET_ONCE = "ray_test_gauge_set_once"


class SetOnce:
    """An actor that sets a plain Ray gauge once (no appliance recorder, no refresher) and then
    lives on: Ray's agent drops it after Ray's expiry, which the test below waits for."""

    def record(self) -> None:
        from ray.util.metrics import Gauge

        self.gauge = Gauge(SET_ONCE.removeprefix("ray_"), "set once, never again")
        self.gauge.set(1.0)


@pytest.mark.integration
def test_a_gauge_set_once_stays_served_while_its_process_lives(ray_metrics_port):
    """Ray's agent drops a gauge a few report intervals after its last set: the weight store's
    bytes (set once, at load) and the validation loss (set once per eval) were missing from
    /metrics and the dashboards for most of a run. Each process now sets its gauges again to
    their last values until it ends. Counters and histograms need nothing (Ray keeps them)."""
    import ray

    actor = ray.remote(num_cpus=0)(RecordGaugesOnce).remote()
    ray.get(actor.record.remote())
    M.DriverMetrics().eval_loss(1.25)  # the driver's gauge
    control = ray.remote(num_cpus=0)(SetOnce).remote()  # lives on, as the actor above does
    ray.get(control.record.remote())
    gauges = {"ray_appliance_weight_store_bytes", "ray_appliance_eval_loss", "ray_appliance_loss"}
    scrape_until(ray_metrics_port, gauges | {SET_ONCE})
    # until Ray's agent has dropped the plain gauge set at the same time (about 20 s): the
    # appliance's, unset since, have outlived Ray's expiry
    deadline = time.monotonic() + 120
    while SET_ONCE in {n for n, _, _ in samples(scrape(ray_metrics_port))}:
        assert time.monotonic() < deadline, f"Ray's agent never dropped {SET_ONCE}: no expiry"
        time.sleep(0.5)
    got = {(n, lb.get("rank")): v for n, lb, v in samples(scrape(ray_metrics_port))}
    assert got[("ray_appliance_weight_store_bytes", None)] == 987654321
    assert got[("ray_appliance_eval_loss", None)] == 1.25
    assert got[("ray_appliance_loss", "0")] == 2.5
    assert got[("ray_appliance_gpu_busy_ratio", "0")] == 0.8
    ray.kill(actor)
    ray.kill(control)


@pytest.mark.integration
def test_appliance_metrics_pass_promtool_lint(recorded):
    """`promtool check metrics` on the appliance's families: naming and type conventions."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed: run scripts/install-prometheus.sh")
    ours, keep = [], False
    for line in recorded.splitlines():
        if line.startswith("# "):
            keep = line.split()[2].startswith("ray_appliance_")
        if keep or line.startswith("ray_appliance_"):
            ours.append(line)
    out = subprocess.run(
        ["promtool", "check", "metrics"],
        input="\n".join(ours) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Ray's own labels (SessionName, NodeAddress, ...) are camelCase; ours are checked to be
    # snake_case in test_registry_names_are_unique_prefixed_and_carry_units.
    problems = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        if line.strip() and "label names should be written in 'snake_case'" not in line
    ]
    assert out.returncode in (0, 3) and not problems, problems
