"""The appliance's metrics: one small recorder per actor, for the names metrics/names.py declares.

Each actor records what it observes with Ray's metrics API (`ray.util.metrics`); the Ray metrics
agent on every node serves those numbers at `http://<node>:<port>/metrics`, next to Ray's own node
metrics (CPU, memory, object store, and, where a GPU exists, GPU utilization and memory).
Prometheus scrapes that endpoint; Grafana draws `helm/appliance/dashboards/*.json`.

Names in code start with `appliance_`; Prometheus shows them with Ray's `ray_` prefix, and counters
with a `_total` suffix (`appliance_tokens` → `ray_appliance_tokens_total`). metrics/names.py holds
them all (`REGISTRY`), and docs/metrics.md is its table.

Recorders are cheap no-ops until Ray is initialized in the process (the engine and the actor
classes run without Ray in tests); the Ray metric objects are created on first use.

    TrainerMetrics(rank=0).record_step(stats)            # Trainer, once per step
    TokenizerMetrics(worker=3).record_totals(...)        # TokenizeWorker, after each batch
    DriverMetrics().batches_in_flight(n)                 # driver step loop, after each step
    DriverMetrics().queue_depth(worker=3, n=2)           # ... and per tokenizer worker
    DriverMetrics().eval_loss(2.1)                       # after each validation
    DriverMetrics().target_share(0.93)                   # after each step
    WeightStoreMetrics().record(bytes_held)              # WeightStore, after loading

The embedded Ray started by `appliance train` serves the endpoint on a fixed port
(metrics/endpoint.py: `choose_metrics_port`, `ray_init_kwargs`, `metrics_url`).

Every metric also carries the label `run` (RUN_TAG): the run's --output, which the driver sets
(`set_run_label`) and hands to every process of its Ray job in the environment variable RUN_ENV.
Dashboards tell runs apart by it: Ray's SessionName is shared by every RayJob on a cluster.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from appliance.metrics.names import (  # fmt: skip
    BATCHES_IN_FLIGHT,
    CHECKPOINTS,
    COUNTER,
    D2H_BYTES,
    DEQUANT_SECONDS,
    DRIVER_RANK,
    EVAL_LOSS,
    EXPERT_SHARE,
    GAUGE,
    GPU_BUSY,
    GPU_ISSUE_LAG,
    GPU_MEMORY_ALLOCATED,
    GPU_MEMORY_RESERVED,
    GPU_NVML_UTILIZATION,
    H2D_BYTES,
    H2D_SECONDS,
    LEARNING_RATE,
    LOSS,
    LOSS_SCALE,
    MFU,
    MODEL_FLOPS,
    OPTIMIZER_HOST_SECONDS,
    PHASE_SECONDS,
    PHASES,
    RESTART_KINDS,
    RESTARTS,
    RUN_TAG,
    SKIPPED_STEPS,
    STEP,
    STEP_SECONDS,
    STEP_TIME_SECONDS,
    STEPS,
    TARGET_SHARE,
    TOKENIZER_DOCUMENTS,
    TOKENIZER_ERRORS,
    TOKENIZER_QUEUE_DEPTH,
    TOKENIZER_SECONDS,
    TOKENIZER_TOKENS,
    TOKENS,
    WEIGHT_STORE_BYTES,
    MetricSpec,
)

logger = logging.getLogger(__name__)

#: The environment variable that carries the run label to every process of the run's Ray job.
RUN_ENV = "APPLIANCE_RUN"


# ---------------------------------------------------------------------- the run label

_run_label: str | None = None


#: a label longer than this is shortened: its head, then a digest of the whole
MAX_LABEL = 200


def run_label(output: str | None) -> str:
    """The `run` label of a run: its --output (unique per run on a cluster, kept by --resume).
    Ray's tags must be printable ASCII: anything else in the path (`runs/jürgen`, a home with an
    accent) is percent-encoded (`runs/j%C3%BCrgen`, as a URL writes it; still one label per
    output), and a path past MAX_LABEL characters is cut, a digest of the whole after it."""
    import hashlib
    import string
    from urllib.parse import quote

    ascii_path = set(string.printable) - set("\t\n\r\x0b\x0c")  # an ASCII path: as it is
    label = quote(output, safe="".join(ascii_path)) if output else "demo"
    if len(label) > MAX_LABEL:
        digest = hashlib.sha256(label.encode()).hexdigest()[:12]
        label = f"{label[: MAX_LABEL - 14]}..{digest}"
    return label


def set_run_label(label: str) -> None:
    """Label this process's metrics with `label` (the driver, at start), including metric objects
    an earlier run in this process created."""
    global _run_label
    _run_label = label
    with _objects_lock:
        for metric in _objects.values():
            metric.set_default_tags({RUN_TAG: label})
        _gauge_values.clear()  # an earlier run's last values are not this run's


def current_run_label() -> str:
    """This process's run label: the driver's own, else RUN_ENV (Ray workers), else ""."""
    return _run_label if _run_label is not None else os.environ.get(RUN_ENV, "")


# ---------------------------------------------------------------------- recorders

_objects: dict[str, Any] = {}
_objects_lock = threading.Lock()


def ray_metrics_enabled() -> bool:
    """True when this process is connected to Ray (a driver after ray.init, or any actor)."""
    ray = sys.modules.get("ray")  # never import Ray just to find out it is not running
    return ray is not None and ray.is_initialized()


def _ray_metric(spec: MetricSpec) -> Any:
    """The process's one ray.util.metrics object for `spec`, created on first use."""
    metric = _objects.get(spec.name)
    if metric is None:
        with _objects_lock:
            metric = _objects.get(spec.name)
            if metric is None:
                from ray.util import metrics as ray_metrics

                tag_keys = (*spec.tag_keys, RUN_TAG)
                if spec.kind == COUNTER:
                    metric = ray_metrics.Counter(spec.name, spec.help, tag_keys)
                elif spec.kind == GAUGE:
                    metric = ray_metrics.Gauge(spec.name, spec.help, tag_keys)
                else:
                    metric = ray_metrics.Histogram(
                        spec.name, spec.help, list(spec.boundaries), tag_keys
                    )
                metric.set_default_tags({RUN_TAG: current_run_label()})
                _objects[spec.name] = metric
    return metric


#: How often each process sets its gauges again to the value it last gave them. Ray 2.60's
#: metrics agent drops a gauge from /metrics some time after its last set (about 20 s in the
#: embedded Ray `train` starts, 2 to 4 s where RAY_metrics_report_interval_ms is 1000 for every
#: process; counters and histograms stay), so
#: a gauge set once (the weight store's bytes, an eval's loss) or once per step of a model whose
#: steps take longer than that (a 70B step on an A10: ~75 s) would be missing from most scrapes
#: and from the dashboards. Half of Ray's shortest interval: no setting of it lets one lapse.
GAUGE_REFRESH_S = 0.5

# (metric name, tags) -> (the Ray gauge, its last value, tags, the Ray session it was set in):
# what the refresher sets again, in that session only
_gauge_values: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, float, dict, str]] = {}
_refresher: threading.Thread | None = None


def _ray_session() -> str:
    """Which Ray session this process is connected to (its GCS address): a process that starts
    Ray again (the tests do) must not set an earlier session's gauges into the new one."""
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - not connected (any more): no session to set gauges in
        return ""


def _set_gauge(metric: Any, name: str, value: float, tags: dict[str, str]) -> None:
    """Set a gauge, and keep setting it to this value until it is given another
    (GAUGE_REFRESH_S says why)."""
    global _refresher
    metric.set(value, tags=tags)
    session = _ray_session()
    with _objects_lock:
        _gauge_values[(name, tuple(sorted(tags.items())))] = (metric, value, tags, session)
        if _refresher is None:
            _refresher = threading.Thread(
                target=_refresh_gauges, name="appliance-gauges", daemon=True
            )
            _refresher.start()


def _refresh_gauges() -> None:
    """The refresher thread: every GAUGE_REFRESH_S, each gauge again to its last value, while
    this process is connected to Ray."""
    while True:
        time.sleep(GAUGE_REFRESH_S)
        if not ray_metrics_enabled():
            continue
        session = _ray_session()
        with _objects_lock:
            for key in [k for k, v in _gauge_values.items() if v[3] != session]:
                del _gauge_values[key]  # set in an earlier Ray session: not this one's
            gauges = list(_gauge_values.values())
        for metric, value, tags, _ in gauges:
            try:
                metric.set(value, tags=tags)
            except Exception:  # noqa: BLE001 - Ray shutting down under us: the next round skips
                break


class _Recorder:
    """Shared plumbing: fixed tags, skip when Ray is off, skip absent (None) values."""

    def __init__(self, **tags: object):
        self.tags = {k: str(v) for k, v in tags.items()}

    @property
    def enabled(self) -> bool:
        return ray_metrics_enabled()

    def _tags(self, spec: MetricSpec, extra: Mapping[str, str]) -> dict[str, str]:
        merged = {**self.tags, **extra}
        return {k: merged[k] for k in spec.tag_keys}

    def _inc(self, spec: MetricSpec, value: float | None, **extra: str) -> None:
        # Counters only go up: Ray rejects 0 and negatives, and nothing is lost by skipping them.
        if value is not None and value > 0:
            _ray_metric(spec).inc(float(value), tags=self._tags(spec, extra))

    def _set(self, spec: MetricSpec, value: float | None, **extra: str) -> None:
        if value is not None:
            _set_gauge(_ray_metric(spec), spec.name, float(value), self._tags(spec, extra))

    def _observe(self, spec: MetricSpec, value: float | None, **extra: str) -> None:
        if value is not None:
            _ray_metric(spec).observe(float(value), tags=self._tags(spec, extra))


class TrainerMetrics(_Recorder):
    """What a Trainer records, once per optimizer step.

    `rank` labels the series ("0" on one GPU). `peak_flops` (FLOP/s, e.g. from
    `hardware.peak_flops_per_second(torch.cuda.get_device_name())`) lets `record_step` derive MFU from
    `stats["flops"]` when the stats carry no `mfu` of their own; None leaves MFU absent.
    """

    def __init__(self, rank: int | str = 0, peak_flops: float | None = None):
        super().__init__(rank=rank)
        self.peak_flops = peak_flops
        self._warned_overlap = False

    def record_step(self, stats: Mapping[str, Any]) -> None:
        """Record one step's stats (the dict `Trainer.step` returns). No-op without Ray.

        Required keys:
          loss (float), tokens (int, input tokens in the step), step_seconds (float, wall clock,
          data wait included).
        Optional keys (absent or None: that metric is not recorded):
          lr; step (1-based number of the step just finished);
          phase_seconds: {phase: seconds} with phases from PHASES except "other" — they must not
            overlap (h2d_stall is not also inside forward/backward); the rest of step_seconds is
            recorded as phase "other";
          h2d_bytes, h2d_seconds, dequant_seconds; expert_share (0..1, MoE); d2h_bytes, optimizer_host_seconds (full
          fine-tuning); flops (model FLOPs of the step); mfu (0..1,
          else derived from flops and peak_flops); gpu_busy_ratio (0..1: CUDA-event busy seconds / step_seconds);
          issue_lag (engine/issue_lag.py's figures: its median_seconds is recorded);
          nvml_util_mean (0..1, from gpu_monitor.NvmlSampler.take_mean()); gpu_mem_allocated,
          gpu_mem_reserved (bytes); loss_scale and skipped_step (float16 compute only).
        Other keys are ignored.
        """
        phases = dict(stats.get("phase_seconds") or {})
        unknown = sorted(set(phases) - set(PHASES[:-1]))
        if unknown:  # checked with Ray off too, so engine tests catch a misspelt phase
            raise ValueError(f"unknown phase(s) {unknown}: expected some of {PHASES[:-1]}")
        if not self.enabled:
            return
        step_seconds = float(stats["step_seconds"])
        attributed = sum(phases.values())
        if attributed > step_seconds * 1.01 + 1e-3 and not self._warned_overlap:
            self._warned_overlap = True
            logger.warning(
                "phase seconds (%.3f) exceed the step's seconds (%.3f): phases overlap, so the "
                "step-time breakdown over-counts",
                attributed,
                step_seconds,
            )
        phases["other"] = max(0.0, step_seconds - attributed)

        self._inc(TOKENS, stats["tokens"])
        self._inc(STEPS, 1)
        self._set(STEP, stats.get("step"))
        self._observe(STEP_SECONDS, step_seconds)
        self._inc(STEP_TIME_SECONDS, step_seconds)
        for phase, seconds in phases.items():
            self._inc(PHASE_SECONDS, seconds, phase=phase)
        self._inc(H2D_BYTES, stats.get("h2d_bytes"))
        self._inc(H2D_SECONDS, stats.get("h2d_seconds"))
        self._inc(DEQUANT_SECONDS, stats.get("dequant_seconds"))
        self._set(EXPERT_SHARE, stats.get("expert_share"))
        self._inc(D2H_BYTES, stats.get("d2h_bytes"))  # full fine-tuning
        self._inc(OPTIMIZER_HOST_SECONDS, stats.get("optimizer_host_seconds"))
        flops = stats.get("flops")
        self._inc(MODEL_FLOPS, flops)
        self._set(LOSS, stats["loss"])
        self._inc(SKIPPED_STEPS, 1 if stats.get("skipped_step") else None)
        self._set(LOSS_SCALE, stats.get("loss_scale"))
        self._set(LEARNING_RATE, stats.get("lr"))
        mfu = stats.get("mfu")
        if mfu is None and flops and self.peak_flops and step_seconds > 0:
            mfu = flops / step_seconds / self.peak_flops
        self._set(MFU, mfu)
        self._set(GPU_BUSY, stats.get("gpu_busy_ratio"))
        lag = stats.get("issue_lag")  # engine/issue_lag.py; None on a CPU
        self._set(GPU_ISSUE_LAG, lag["median_seconds"] if lag else None)
        self._set(GPU_NVML_UTILIZATION, stats.get("nvml_util_mean"))
        self._set(GPU_MEMORY_ALLOCATED, stats.get("gpu_mem_allocated"))
        self._set(GPU_MEMORY_RESERVED, stats.get("gpu_mem_reserved"))


class TokenizerMetrics(_Recorder):
    """What a TokenizeWorker records; `worker` is its index (the `worker` label)."""

    def __init__(self, worker: int | str):
        super().__init__(worker=worker)
        self._last = {"tokens": 0, "documents": 0, "errors": 0, "seconds": 0.0}

    def record(
        self, tokens: int = 0, documents: int = 0, errors: int = 0, seconds: float = 0.0
    ) -> None:
        """Add work done since the last call (increments). No-op without Ray.

        tokens: tokens packed; documents: records tokenized; errors: bad records skipped;
        seconds: busy time. (Its queue depth is the driver's to record: DriverMetrics.queue_depth.)
        """
        if not self.enabled:
            return
        self._inc(TOKENIZER_TOKENS, tokens)
        self._inc(TOKENIZER_DOCUMENTS, documents)
        self._inc(TOKENIZER_ERRORS, errors)
        self._inc(TOKENIZER_SECONDS, seconds)

    def record_totals(
        self,
        tokens_total: int,
        documents_total: int,
        errors_total: int = 0,
        seconds_total: float = 0.0,
    ) -> None:
        """Record from the worker's cumulative counters (e.g. TokenizeWorker.tokens_total,
        .documents_total, .skipped_total, .tokenize_seconds): the increments since the last call
        are added. No-op without Ray."""
        now = {
            "tokens": tokens_total,
            "documents": documents_total,
            "errors": errors_total,
            "seconds": seconds_total,
        }
        delta = {k: v - self._last[k] for k, v in now.items()}
        self._last = now
        self.record(**delta)


class DriverMetrics(_Recorder):
    """What the driver (the `appliance train` process) records. Safe to create before ray.init."""

    def batches_in_flight(self, n: int) -> None:
        """Micro-batches requested from workers and not yet consumed, after each step."""
        if self.enabled:
            self._set(BATCHES_IN_FLIGHT, n)

    def queue_depth(self, worker: int, n: int) -> None:
        """Batches requested from tokenizer worker `worker` and not yet consumed by the trainer,
        after each step (set it for every worker, 0 included, so a drained worker reads 0)."""
        if self.enabled:
            self._set(TOKENIZER_QUEUE_DEPTH, n, worker=str(worker))

    def eval_loss(self, loss: float) -> None:
        """The validation loss just computed (every --eval-every steps and at the end)."""
        if self.enabled:
            self._set(EVAL_LOSS, loss)

    def target_share(self, ratio: float) -> None:
        """Target tokens / row positions so far, after each step."""
        if self.enabled:
            self._set(TARGET_SHARE, ratio)

    def restart(self, kind: str) -> None:
        """One restart after a failure; `kind` is one of RESTART_KINDS."""
        if kind not in RESTART_KINDS:
            raise ValueError(f"restart kind {kind!r}: expected one of {RESTART_KINDS}")
        if self.enabled:
            self._inc(RESTARTS, 1, kind=kind)

    def checkpoint_seconds(self, seconds: float) -> None:
        """One checkpoint written between steps, taking `seconds` (phase `checkpoint`, rank
        `driver`)."""
        if self.enabled:
            self._inc(CHECKPOINTS, 1)
            self._inc(PHASE_SECONDS, seconds, rank=DRIVER_RANK, phase="checkpoint")


class WeightStoreMetrics(_Recorder):
    """What a WeightStore records (one per node)."""

    def record(self, bytes_held: int) -> None:
        """Bytes of base weights held in the object store, after loading. No-op without Ray."""
        if self.enabled:
            self._set(WEIGHT_STORE_BYTES, bytes_held)
