"""Every metric the appliance records, declared once: name, Prometheus type, unit, labels, meaning.

Names in code start with `appliance_`; Prometheus shows them with Ray's `ray_` prefix, and counters
with a `_total` suffix (`appliance_tokens` → `ray_appliance_tokens_total`). `REGISTRY` is the one
list; docs/metrics.md is its table (`python -m appliance.metrics.names` prints it) and a test keeps
the two equal. The recorders that set them are in metrics/recorders.py.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)
PREFIX = "appliance_"
RAY_PREFIX = "ray_"  # what Ray's exporter puts in front of every metric name

#: Phases of `appliance_phase_seconds`. A trainer's phases partition its step time; whatever it
#: does not attribute is recorded as `other`. `checkpoint` with `rank="driver"` is the driver
#: writing a checkpoint between steps (not part of any step).
PHASES = (
    "forward", "backward", "optimizer", "data_wait", "h2d_stall", "h2d_host", "checkpoint", "other"
)  # fmt: skip
#: What `DriverMetrics.restart(kind)` accepts: `trainer` (the trainer actor died and was
#: recreated), `tokenizer` (a tokenizer worker died; all are recreated at their cursors),
#: `driver` (an `appliance train --resume` continued from a checkpoint).
RESTART_KINDS = ("trainer", "tokenizer", "driver")
#: The `rank` label value for phases the driver measures (checkpoints).
DRIVER_RANK = "driver"
#: The label every appliance metric carries besides its own: which run recorded it.
RUN_TAG = "run"

#: Bucket bounds of `appliance_step_seconds`: a tiny demo step on a CPU (~50 ms) to a 70B step
#: streamed from host memory (~75 s on an A10), with room on both sides.
STEP_SECONDS_BOUNDARIES = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name in code, Prometheus type, unit, labels and meaning."""

    name: str  # passed to ray.util.metrics; starts with `appliance_`
    kind: str  # counter | gauge | histogram
    unit: str  # what one unit of the value is ("seconds", "bytes", "ratio" = 0..1, ...)
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric {self.name!r} must start with {PREFIX!r}")
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name!r}: kind must be one of {KINDS}")
        if self.kind == COUNTER and self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r}: Ray's exporter adds `_total` itself")
        if (self.kind == HISTOGRAM) != bool(self.boundaries):
            raise ValueError(f"metric {self.name!r}: boundaries are for histograms, and only them")

    @property
    def prometheus_name(self) -> str:
        """The name to query in Prometheus (a histogram adds `_bucket`, `_sum`, `_count`)."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == COUNTER else "")

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The sample names this metric appears under in a scrape."""
        if self.kind == HISTOGRAM:
            return tuple(self.prometheus_name + s for s in ("_bucket", "_sum", "_count"))
        return (self.prometheus_name,)

    @property
    def help(self) -> str:
        """The `# HELP` text: the description with its unit."""
        return f"{self.description} [{self.unit}]"


# ---------------------------------------------------------------------- the names (once)

# Trainer (label rank: the trainer's rank, "0" on one GPU)
TOKENS = MetricSpec(
    "appliance_tokens", COUNTER, "tokens",
    "Input tokens trained on (micro-batch size x sequence length x micro-batches, per step).",
    ("rank",),
)  # fmt: skip
STEPS = MetricSpec("appliance_steps", COUNTER, "steps", "Optimizer steps completed.", ("rank",))
STEP = MetricSpec(
    "appliance_step", GAUGE, "steps", "Number of the last completed step (1-based).", ("rank",)
)
STEP_SECONDS = MetricSpec(
    "appliance_step_seconds", HISTOGRAM, "seconds",
    "Wall-clock seconds per optimizer step, data wait included (for quantiles; Ray approximates "
    "a histogram's _sum from bucket midpoints, so totals come from appliance_step_time_seconds).",
    ("rank",), STEP_SECONDS_BOUNDARIES,
)  # fmt: skip
STEP_TIME_SECONDS = MetricSpec(
    "appliance_step_time_seconds", COUNTER, "seconds",
    "Wall-clock seconds spent in optimizer steps: the exact sum of step seconds, which the "
    "trainer's phases add up to.",
    ("rank",),
)  # fmt: skip
PHASE_SECONDS = MetricSpec(
    "appliance_phase_seconds", COUNTER, "seconds",
    "Seconds per phase: forward, backward, optimizer, data_wait (waiting for a batch), h2d_stall "
    "(compute waiting for a host-to-device copy: weights, or offloaded activations), h2d_host "
    "(the host blocked staging weights into page-locked memory), checkpoint, other (step time "
    "no phase claimed). "
    'Rank "driver" carries the checkpoints written between steps (by rank 0; the driver waits).',
    ("rank", "phase"),
)  # fmt: skip
H2D_BYTES = MetricSpec(
    "appliance_h2d_bytes", COUNTER, "bytes",
    "Bytes of base-model block weights copied host to device.", ("rank",),
)  # fmt: skip
H2D_SECONDS = MetricSpec(
    "appliance_h2d_seconds", COUNTER, "seconds",
    "Seconds the host-to-device weight copies took on the copy stream (overlaps compute; "
    "bandwidth = rate of bytes / rate of seconds).",
    ("rank",),
)  # fmt: skip
DEQUANT_SECONDS = MetricSpec(
    "appliance_dequant_seconds", COUNTER, "seconds",
    "Seconds spent dequantizing a quantized base's block weights on the compute device "
    "(--base-quant; inside forward and backward, not a phase of its own).",
    ("rank",),
)  # fmt: skip
EXPERT_SHARE = MetricSpec(
    "appliance_expert_share_ratio", GAUGE, "ratio",
    "Mixture-of-experts models: share of a streamed block's experts copied to the device per "
    "copy of the block, over the last step (expert-granular streaming copies only the experts "
    "the step's tokens were routed to; 1: all of them). Absent for dense models and for MoE "
    "blocks that cross whole (resident, quantized, or experts fused in one tensor).",
    ("rank",),
)  # fmt: skip
D2H_BYTES = MetricSpec(
    "appliance_d2h_bytes", COUNTER, "bytes",
    "Bytes of fp32 weight gradients copied device to host (--finetuning-type full; 0 on a CPU).",
    ("rank",),
)  # fmt: skip
OPTIMIZER_HOST_SECONDS = MetricSpec(
    "appliance_optimizer_host_seconds", COUNTER, "seconds",
    "Seconds the host's AdamW worked (--finetuning-type full), beside the GPU; the optimizer "
    "phase is the part the step waited for, so 1 - optimizer phase / this is the overlap.",
    ("rank",),
)  # fmt: skip
MODEL_FLOPS = MetricSpec(
    "appliance_model_flops", COUNTER, "FLOP",
    "Model FLOPs of the steps: F of the speed floor (the blocks' matmuls, LoRA, causal attention "
    "with the recompute, the LM head: docs/benchmarks.md, The floor); its rate is the achieved "
    "FLOP/s.",
    ("rank",),
)  # fmt: skip
LOSS = MetricSpec(
    "appliance_loss", GAUGE, "nats/token",
    "Training loss of the last step (mean next-token cross-entropy over the global batch).",
    ("rank",),
)  # fmt: skip
SKIPPED_STEPS = MetricSpec(
    "appliance_skipped_steps", COUNTER, "steps",
    "Optimizer steps skipped because a gradient overflowed (float16 compute: the step left the "
    "adapter as it was and halved the loss scale). Counted in appliance_steps too.",
    ("rank",),
)  # fmt: skip
LOSS_SCALE = MetricSpec(
    "appliance_loss_scale", GAUGE, "1",
    "The loss scale the last step's backward was seeded with (float16 compute only; halved on "
    "an overflow, doubled after 2000 good steps). Absent in bfloat16 and float32.",
    ("rank",),
)  # fmt: skip
LEARNING_RATE = MetricSpec(
    "appliance_learning_rate", GAUGE, "1", "Learning rate of the last step.", ("rank",)
)
MFU = MetricSpec(
    "appliance_mfu_ratio", GAUGE, "ratio",
    "Model FLOPs utilization of the last step: model FLOPs / step seconds / the GPU's peak dense "
    "bf16 FLOP/s. Absent on a CPU or an unknown GPU.",
    ("rank",),
)  # fmt: skip
GPU_BUSY = MetricSpec(
    "appliance_gpu_busy_ratio", GAUGE, "ratio",
    "Share of the last step the GPU's compute stream was busy: busy seconds (the sum of the "
    "CUDA-event-timed intervals bracketing real work, waits for block weights excluded) divided "
    "by the step's wall-clock seconds, data wait included. Absent on a CPU.",
    ("rank",),
)  # fmt: skip
GPU_ISSUE_LAG = MetricSpec(
    "appliance_gpu_issue_lag_seconds", GAUGE, "seconds",
    "How far the GPU's work on a block lagged the host's issue of it in the last step, the median "
    "over the blocks of both passes (a CUDA event recorded as the host finishes issuing a block, "
    "against the host's clock at that moment): near zero, the GPU waited for the host "
    "(launch-bound); growing through a pass, the host ran ahead (GPU-bound). Absent on a CPU.",
    ("rank",),
)  # fmt: skip
GPU_NVML_UTILIZATION = MetricSpec(
    "appliance_gpu_nvml_utilization_ratio", GAUGE, "ratio",
    "Mean NVML GPU utilization over the last step, sampled at 20 Hz (what nvidia-smi shows: the "
    "share of time any kernel ran). Absent without a GPU.",
    ("rank",),
)  # fmt: skip
GPU_MEMORY_ALLOCATED = MetricSpec(
    "appliance_gpu_memory_allocated_bytes", GAUGE, "bytes",
    "GPU memory held by tensors after the last step (torch.cuda.memory_allocated). Absent on "
    "a CPU.",
    ("rank",),
)  # fmt: skip
GPU_MEMORY_RESERVED = MetricSpec(
    "appliance_gpu_memory_reserved_bytes", GAUGE, "bytes",
    "GPU memory reserved by PyTorch's caching allocator after the last step "
    "(torch.cuda.memory_reserved). Absent on a CPU.",
    ("rank",),
)  # fmt: skip

# TokenizeWorker (label worker: the worker's index)
TOKENIZER_TOKENS = MetricSpec(
    "appliance_tokenizer_tokens", COUNTER, "tokens",
    "Tokens packed into batches by this tokenizer worker (read-ahead included).", ("worker",),
)  # fmt: skip
TOKENIZER_DOCUMENTS = MetricSpec(
    "appliance_tokenizer_documents", COUNTER, "documents",
    "Documents (dataset records) tokenized by this worker.", ("worker",),
)  # fmt: skip
TOKENIZER_ERRORS = MetricSpec(
    "appliance_tokenizer_errors", COUNTER, "records",
    "Bad records this worker skipped (unreadable JSON, missing or empty text).", ("worker",),
)  # fmt: skip
TOKENIZER_SECONDS = MetricSpec(
    "appliance_tokenizer_seconds", COUNTER, "seconds",
    "Seconds this worker spent reading, tokenizing and packing (its busy time).", ("worker",),
)  # fmt: skip
# Driver
BATCHES_IN_FLIGHT = MetricSpec(
    "appliance_batches_in_flight", GAUGE, "batches",
    "Micro-batches requested from tokenizer workers and not yet consumed by a step (the prefetch "
    "window).",
)  # fmt: skip
TOKENIZER_QUEUE_DEPTH = MetricSpec(
    "appliance_tokenizer_queue_depth", GAUGE, "batches",
    "Per tokenizer worker, as the driver sees it after each step: batches requested from that "
    "worker and not yet consumed by the trainer (its share of appliance_batches_in_flight; a "
    "worker keeps no queue of its own).",
    ("worker",),
)  # fmt: skip
EVAL_LOSS = MetricSpec(
    "appliance_eval_loss", GAUGE, "nats/token",
    "Validation loss of the last evaluation (--eval-data or --eval-split, every --eval-every "
    "steps): mean next-token cross-entropy over the held-out documents' target tokens.",
)  # fmt: skip
TARGET_SHARE = MetricSpec(
    "appliance_target_share_ratio", GAUGE, "ratio",
    "Target tokens / row positions of the run so far: the share of the rows' positions that "
    "train (padding, prompts and non-assistant turns do not; chat data packed without padding "
    "is still well under 1).",
)  # fmt: skip
RESTARTS = MetricSpec(
    "appliance_restarts", COUNTER, "restarts",
    "Restarts, by kind: trainer (the trainer actor died and was recreated), tokenizer (a "
    "tokenizer worker died; all workers were recreated at their cursors), driver (a --resume "
    "continued from a checkpoint).",
    ("kind",),
)  # fmt: skip
CHECKPOINTS = MetricSpec(
    "appliance_checkpoints", COUNTER, "checkpoints",
    'Checkpoints written (their seconds: appliance_phase_seconds{phase="checkpoint"}).',
)  # fmt: skip

# WeightStore (one per node; Ray's NodeAddress label tells the nodes apart)
WEIGHT_STORE_BYTES = MetricSpec(
    "appliance_weight_store_bytes", GAUGE, "bytes",
    "Bytes of base-model weights this node's WeightStore holds in the Ray object store.",
)  # fmt: skip

REGISTRY: tuple[MetricSpec, ...] = (
    TOKENS, STEPS, STEP, STEP_SECONDS, STEP_TIME_SECONDS, PHASE_SECONDS, H2D_BYTES, H2D_SECONDS,
    DEQUANT_SECONDS, EXPERT_SHARE, D2H_BYTES, OPTIMIZER_HOST_SECONDS,
    MODEL_FLOPS, LOSS, SKIPPED_STEPS, LOSS_SCALE, LEARNING_RATE, MFU, GPU_BUSY, GPU_ISSUE_LAG,
    GPU_NVML_UTILIZATION, GPU_MEMORY_ALLOCATED, GPU_MEMORY_RESERVED, TOKENIZER_TOKENS,
    TOKENIZER_DOCUMENTS, TOKENIZER_ERRORS, TOKENIZER_SECONDS, BATCHES_IN_FLIGHT,
    TOKENIZER_QUEUE_DEPTH, RESTARTS, CHECKPOINTS,
    WEIGHT_STORE_BYTES, EVAL_LOSS, TARGET_SHARE,
)  # fmt: skip


def by_name() -> dict[str, MetricSpec]:
    """The registry keyed by name in code."""
    return {spec.name: spec for spec in REGISTRY}


# ---------------------------------------------------------------------- docs/metrics.md

TABLE_HEADER = (
    "| Prometheus name | type | unit | labels | meaning |",
    "| --- | --- | --- | --- | --- |",
)


def markdown_row(spec: MetricSpec) -> str:
    labels = ", ".join(f"`{k}`" for k in spec.tag_keys) or "-"
    description = spec.description.replace("|", "\\|")
    return f"| `{spec.prometheus_name}` | {spec.kind} | {spec.unit} | {labels} | {description} |"


def markdown_table() -> str:
    """The metrics table of docs/metrics.md (a test keeps the file equal to this)."""
    return "\n".join([*TABLE_HEADER, *(markdown_row(s) for s in REGISTRY)])
