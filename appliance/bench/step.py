"""`appliance bench`: the streamed step against its floor and against resident training.

    python -m appliance.bench --preset tiny --json bench.json            # seconds, on a CPU
    python -m appliance.bench --preset 13b --gpu-memory-budget 24GiB    # on a GPU
    python -m appliance.bench --preset 7b     # on a GPU: a budget that streams half the blocks

A preset (appliance/models/presets.py) is a real model's shape (Llama, Qwen3, Gemma 2/3, Phi-4-mini)
with random weights made in memory (nothing is downloaded). The same model and batches run twice
in one process: streamed (under `--gpu-memory-budget`, so blocks that
do not fit are copied host→device every pass) and resident (every block on the device, when the
whole model fits the device; else the row says "does not fit"). Each mode runs warm-up steps,
then timed optimizer steps.

On CUDA the streamed row runs at `--gpu-memory-budget`, or by default at the largest budget under
which at least half the blocks stream (memory.streaming_budget); a budget that keeps every block
resident is refused, since it would time ordinary training.

The floor of one step (docs/architecture.md, "The speed floor") is max(W / B, F / P): W = the
bytes the engine copies host→device in one step (each streamed block once per pass, less block 0,
which stays from one step's backward into the next forward, and less the last block when none is
resident: memory.blocks_uploaded_per_step; the engine's own count is reported beside it),
B = bandwidth measured from the memory the engine copies from (one of its own page-locked blocks
into the device, median of 10, on CUDA; a host memcpy of 256 MiB on CPU, where nothing is
really copied: weights are read in place, so the row is nominal), F = the
step's FLOPs (engine/flops.py: the blocks' matmuls, LoRA, causal attention with the recompute,
the LM head), P = the measured dense matmul rate in the compute dtype (`--dtype
auto`: bf16 on GPU, fp16 on one without bf16, fp32 on CPU). Every row reports its time against
that floor. W is the weights alone: where the plan offloads saved block inputs to the host, the
bytes they bring back in the backward (all blocks' but the last's, which stay on the device) are
reported beside it (`offload_h2d_bytes_per_step`). Beside the floor, not in it: the step's least
elementwise bytes (engine/flops.py) over the device's memory bandwidth (a 256 MiB device copy,
read and written: `floor_elementwise_seconds`).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from appliance import quant
from appliance.actors.trainer import resolve_dtype
from appliance.bench.synthetic import SyntheticBlockSource
from appliance.engine.blocks import dtype_from_name
from appliance.engine.device_weights import with_index
from appliance.engine.flops import elementwise_bytes, lora_active_params, step_flops
from appliance.engine.full import FullFinetuneEngine
from appliance.engine.issue_lag import mean_of_steps
from appliance.engine.memory import blocks_uploaded_per_step, gpu_memory_cap, streaming_budget
from appliance.engine.step import StreamedEngine
from appliance.errors import ConfigError, first_line
from appliance.hardware.gpu_monitor import NvmlSampler
from appliance.hardware.measure import (
    COPY_BYTES,
    GiB,
    MiB,
    cpu_name,
    cuda_copy_seconds,
    device_name,
    host_memory_available,
    measure_bandwidth,
    measure_matmul,
)
from appliance.models import (
    block_param_count,
    block_shapes,
    linear_weight_names,
    param_count,
    resolve_targets,
)
from appliance.models.layers import ModelArgs
from appliance.models.lora import LoraSpec, LoraWeights
from appliance.models.presets import PRESETS, Shape
from appliance.plan import full

LR = 1e-4
MODES = ("streamed", "resident")  # the rows, in order

# ---------------------------------------------------------------- the runs


def _batches(
    args: ModelArgs, shape: Shape, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(shape.micro_batches):
        ids = torch.randint(
            0, args.vocab_size, (shape.micro_batch_size, shape.seq_len + 1), generator=gen
        )
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _release_cuda(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # (the streamed row's memory cap went with its `with` block)


def _run_mode(
    mode: str,
    source: SyntheticBlockSource,
    batches: list,
    shape: Shape,
    device: torch.device,
    dtype: torch.dtype,
    budget: int | None,
    bandwidth: float,
    matmul: float,
    profile: bool = False,
    compile_blocks: bool = False,
    full_finetune: bool = False,
    kernels: str = "exact",
) -> dict:
    args, L = source.args, source.args.num_layers
    row: dict = {"mode": mode, "tokens_per_step": sum(ids.numel() for ids, _ in batches)}
    if device.type == "cuda":  # peak_gpu_bytes: this mode's own peak (benchmarks/compare.py)
        torch.cuda.reset_peak_memory_stats(device)
    lora = None if full_finetune else LoraWeights(args, LoraSpec(), device, seed=0)
    kw = dict(device=device, dtype=dtype, compile_blocks=compile_blocks,
              gpu_memory_budget=budget if mode == "streamed" else None)  # fmt: skip
    engine = (
        FullFinetuneEngine(source, **kw)
        if full_finetune
        else StreamedEngine(source, lora, kernels=kernels, **kw)
    )
    measured_b = None  # B from the engine's own host memory (CUDA, streamed)
    try:
        if mode == "resident" and device.type == "cuda":
            # Decide before running whether every block stays on the device (the engine's own
            # plan, with the whole device as budget); if not, this mode does not exist here.
            try:
                engine.plan(batches)
            except ConfigError as e:
                return {**row, "fits": False, "reason": f"does not fit: {e}"}
            if len(engine.weights.resident) < L:
                return {
                    **row,
                    "fits": False,
                    "reason": f"does not fit: {len(engine.weights.resident)} of {L} blocks fit "
                    f"in {torch.cuda.get_device_properties(device).total_memory / GiB:.0f} GiB",
                }
        if mode == "streamed" and device.type == "cuda":
            engine.plan(batches)  # ConfigError (names the flag) if even streaming does not fit
            if len(engine.weights.resident) == L:
                fit = streaming_budget(args, **engine.plan_inputs(batches))
                raise ConfigError(
                    f"--gpu-memory-budget {budget / GiB:.3g} GiB keeps all {L} blocks resident: "
                    "nothing streams, so the streamed row would time ordinary training; leave "
                    "the flag out (the bench then streams half the blocks)"
                    + (f" or give at most {fit / GiB:.3g} GiB" if fit else "")
                )
            measured_b = engine.weights.measure_bandwidth()
        losses, timed, nvml = [], [], []
        sampler = NvmlSampler.for_cuda_device(device.index or 0) if device.type == "cuda" else None
        for s in range(shape.warmup + shape.steps):
            if sampler and s == shape.warmup:
                sampler.start()  # utilization as nvidia-smi sees it, over the timed steps
            stats = engine.train_step(batches, LR)
            losses.append(stats.loss)
            if s >= shape.warmup:
                timed.append(stats)
                if sampler and (mean := sampler.take_mean()) is not None:
                    nvml.append(mean)
        if sampler:
            sampler.stop()
        profile_table = _profile_step(engine, batches, device) if profile else None
        if device.type == "cuda":
            resident = len(engine.weights.resident)  # the engine's plan under this budget
        else:  # weights are read in place; "streamed" counts every block as if copied (nominal)
            resident = L if mode == "resident" else 0
        block_bytes = engine.weights.block_bytes()
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        # what the budget caps (reserved), and whether the allocator had to free and retry
        allocator = _allocator_facts(device)
    except torch.cuda.OutOfMemoryError as e:
        return {**row, "fits": False, "reason": f"CUDA out of memory: {first_line(e)}"}
    finally:
        engine.close()  # unregister the page-locked blocks before anything can free them
        del engine, lora
        _release_cuda(device)

    # the bytes one steady-state step copies (block 0 stays between steps; planner's count;
    # full fine-tuning copies every block again after its update: plan/full.py)
    uploads = full.blocks_uploaded_per_step if full_finetune else blocks_uploaded_per_step
    W = uploads(L, resident) * block_bytes
    B = measured_b or bandwidth
    step = statistics.mean(s.step_seconds for s in timed)
    flops = timed[0].flops  # the engine's F (engine/flops.py), by part below
    shapes = [tuple(ids.shape) for ids, _ in batches]
    spec = LoraSpec()
    lora_n = 0 if full_finetune else lora_active_params(args, spec.rank, spec.targets)
    parts = step_flops(args, shapes, lora_params=lora_n, full=full_finetune,
                       head_trained=full_finetune)  # fmt: skip
    h2d_bytes = statistics.mean(s.h2d_bytes for s in timed)
    h2d_seconds = statistics.mean(s.h2d_seconds for s in timed)
    floor_h2d, floor_compute = W / B, flops / matmul
    floor = max(floor_h2d, floor_compute)
    if full_finetune:  # fp32 gradients device→host, on the link's other direction
        d2h = 4 * timed[0].trained_parameters
        floor = max(floor, d2h / B)
        row["full_finetune"] = {
            "trained_parameters": timed[0].trained_parameters,
            "d2h_bytes_per_step": d2h,
            "d2h_bytes_measured_per_step": statistics.mean(s.d2h_bytes for s in timed),
            "floor_d2h_seconds": d2h / B,
            "optimizer_host_seconds_per_step": statistics.mean(
                s.optimizer_host_seconds for s in timed
            ),
            "optimizer_exposed_seconds_per_step": statistics.mean(
                s.phase_seconds["optimizer"] for s in timed
            ),
        }
    busy = [s.gpu_busy_ratio for s in timed if s.gpu_busy_ratio is not None]
    busy_seconds = [s.gpu_busy_seconds for s in timed if s.gpu_busy_seconds is not None]
    issue = [s.host_issue_seconds / s.step_seconds for s in timed if s.host_issue_seconds]
    dequant = statistics.mean(s.dequant_seconds for s in timed)
    shares = [s.expert_share for s in timed if s.expert_share is not None]
    return {
        **row,
        "fits": True,
        "nvml_util_mean": statistics.mean(nvml) if nvml else None,
        "profile": profile_table,
        "resident_blocks": resident,
        "blocks": L,
        "streamed_blocks": L - resident,
        "streamed_bytes": W,
        "bandwidth_bytes_per_second": B,
        "peak_gpu_bytes": peak,  # torch.cuda.max_memory_allocated over the mode; None on a CPU
        **allocator,
        "step_seconds": step,
        "step_seconds_min": min(s.step_seconds for s in timed),
        "step_seconds_median": statistics.median(s.step_seconds for s in timed),
        "tokens_per_second": row["tokens_per_step"] / step,
        "flops_per_step": flops,
        "flops_by_part": parts.as_dict(),
        # the least elementwise bytes of the step; their seconds beside the floor: run_bench
        "elementwise_bytes_per_step": elementwise_bytes(args, shapes, dtype.itemsize),
        "floor_h2d_seconds": floor_h2d,
        "floor_compute_seconds": floor_compute,
        "floor_seconds": floor,
        # T*: the tokens per step at which W/B = F/P (F grows with the tokens, W does not);
        # above it the step is compute-bound, and the Proof's step/floor figure applies
        "crossover_tokens_per_step": row["tokens_per_step"] * floor_h2d / floor_compute,
        "ratio": step / floor,
        "dequant_seconds_per_step": dequant,
        "dequant_share": dequant / step,
        "h2d_bytes_per_step": h2d_bytes,
        # MoE, expert-granular streaming: the share of a streamed block's experts copied per
        # copy (StepStats.expert_share); None where no block streamed by expert
        "expert_share": statistics.mean(shares) if shares else None,
        # offloaded activations coming back in the backward: host→device too, beside W (which
        # counts weights only, as the floor is defined); 0 when the saved inputs stay on device
        "offload_h2d_bytes_per_step": statistics.mean(s.offload_h2d_bytes for s in timed),
        "h2d_seconds_per_step": h2d_seconds,
        "h2d_stall_seconds_per_step": statistics.mean(s.phase_seconds["h2d_stall"] for s in timed),
        "gpu_busy_seconds_per_step": statistics.mean(busy_seconds) if busy_seconds else None,
        "gpu_busy_ratio": statistics.mean(busy) if busy else None,
        # the host's share of the step spent issuing work (CUDA): near 1, the step is
        # launch-bound, and GPU busy (brackets that include launch gaps) overstates the GPU's work
        "host_issue_ratio": statistics.mean(issue) if issue else None,
        # per block, how far the GPU's completion lagged the host's issue (CUDA; None on a CPU,
        # where nothing is recorded): engine/issue_lag.py, the timed steps' mean
        "issue_lag": mean_of_steps([s.issue_lag for s in timed]),
        "phase_seconds": {
            k: statistics.mean(s.phase_seconds[k] for s in timed) for k in timed[0].phase_seconds
        },
        "losses": losses,
    }


def _allocator_facts(device: torch.device) -> dict:
    """The caching allocator over a mode (CUDA; empty on a CPU): its peak reserved bytes (what
    --gpu-memory-budget caps), and how often it freed its cache to retry (`num_alloc_retries`)
    or gave up (`num_ooms`): a row that runs out of memory is read with these."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_reserved_gpu_bytes": torch.cuda.max_memory_reserved(device),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
    }


def model_facts(args: ModelArgs, dtype: torch.dtype) -> dict:
    """The shape a result was measured on (the bench's and the peers' JSON), and its unquantized
    bytes in `dtype`."""
    return {
        "architecture": args.architecture,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "params": param_count(args),
        "block_bytes": block_param_count(args) * dtype.itemsize,
        "weight_bytes": param_count(args) * dtype.itemsize,
    }


def _profile_step(engine: StreamedEngine, batches: list, device: torch.device) -> str:
    """One more step under torch.profiler: its operators by self time (device time on CUDA),
    the top 25, as the profiler's own table. What a row that misses its floor is read with."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.train_step(batches, LR)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=25)


def run_bench(
    preset: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    gpu_memory_budget: int | None = None,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    micro_batches: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    base_quant: str = "none",
    profile: bool = False,
    compile_blocks: bool = False,
    kernels: str = "exact",
    modes: tuple[str, ...] = MODES,
    on_row: Callable[[dict], None] | None = None,
    finetuning_type: str = "lora",
) -> dict:
    """Run `preset` streamed and resident; returns every measured number (see module doc).
    `on_row`: called with the result so far after each row (the bench's --json writes it then,
    so a run killed in its second row keeps the first).
    `base_quant` (int8 | nf4): the blocks' linear weights are quantized (as --base-quant).
    `profile`: each row also profiles one step more (torch.profiler; the row's "profile").
    `compile_blocks`: the engine's blocks through torch.compile (train --compile-blocks); the
    warm-up steps take the compiling.
    `kernels`: the block kernels' tier, as train --kernels (exact | fast).
    `modes`: the rows to run (both by default; `("streamed",)` saves a big model's resident
    row where only the streamed one is wanted).
    `finetuning_type` "full": every weight trains (engine/full.py); the floor counts 8·N·T and
    the fp32 gradients' device→host bytes, and each row says the CPU AdamW's time and how much
    of it the step waited for.

    `None` picks the preset's default for the device; dtype defaults to the trainer's (`--dtype
    auto`: trainer.resolve_dtype). ConfigError for a preset that cannot run here, with what to
    do instead.
    """
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is unknown; one of {', '.join(PRESETS)}")
    if finetuning_type == "full" and base_quant != "none":
        raise ConfigError("--finetuning-type full trains every weight: give --base-quant none")
    if not modes or any(m not in MODES for m in modes):
        raise ConfigError(f"--modes {','.join(modes)}: give one or both of {','.join(MODES)}")
    p, device = PRESETS[preset], torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    device = with_index(device)  # "cuda" → the current device: torch.cuda calls need an index
    if device.type == "cpu":
        if p.cpu is None:
            cpu_ok = " and ".join(k for k, v in PRESETS.items() if v.cpu)
            raise ConfigError(
                f"--preset {preset} needs a GPU (--device cuda): on a CPU only {cpu_ok} run "
                "in useful time"
            )
        if gpu_memory_budget is not None:
            raise ConfigError("--gpu-memory-budget applies to --device cuda only")
    if dtype is None:
        dtype = dtype_from_name(resolve_dtype("auto", device.type))
    default = p.gpu if device.type == "cuda" else p.cpu
    shape = Shape(
        default.micro_batch_size if micro_batch_size is None else micro_batch_size,
        default.seq_len if seq_len is None else seq_len,
        default.micro_batches if micro_batches is None else micro_batches,
        default.steps if steps is None else steps,
        default.warmup if warmup is None else warmup,
    )
    for flag, v in (
        ("--micro-batch-size", shape.micro_batch_size),
        ("--seq-len", shape.seq_len),
        ("--micro-batches-per-step", shape.micro_batches),
        ("--steps", shape.steps),
    ):
        if v < 1:
            raise ConfigError(f"{flag} must be ≥ 1, got {v}")
    if shape.warmup < 0:
        raise ConfigError(f"--warmup must be ≥ 0, got {shape.warmup}")
    args = p.args
    weight_bytes = param_count(args) * dtype.itemsize
    if base_quant != "none":  # the blocks' linear weights quantized, the rest in dtype
        for i in range(args.num_layers):  # (blocks differ by kind in Qwen3.5 and Gemma 4)
            shapes = block_shapes(args, i)
            linear = [shapes[name] for name in linear_weight_names(args, i)]
            weight_bytes -= sum(math.prod(s) * dtype.itemsize for s in linear)
            weight_bytes += sum(quant.quantized_nbytes(s, base_quant) for s in linear)
    available = host_memory_available()
    if available is not None and weight_bytes > 0.9 * available:
        raise ConfigError(
            f"--preset {preset}: its {str(dtype).removeprefix('torch.')} weights need "
            f"{weight_bytes / GiB:.1f} GiB of host memory; {available / GiB:.1f} GiB is available "
            "here (the blocks stream from host memory, so all of them live there)"
        )

    if device.type == "cuda":
        _release_cuda(device)  # cached blocks an earlier engine left would skew this
        n, reps = 8192, 20
    else:
        n, reps = 2048, 3
    bandwidth = measure_bandwidth(device)
    matmul = measure_matmul(device, dtype, n, reps)
    memory_bw = measure_memory_bandwidth(device)
    dname = str(dtype).removeprefix("torch.")
    source = SyntheticBlockSource(args, dtype, base_quant=base_quant)
    source.make_all()  # on the host's cores, before anything is timed
    batches = _batches(args, shape)
    budget_kind = "--gpu-memory-budget" if gpu_memory_budget else None
    if device.type == "cuda" and gpu_memory_budget is None:
        # the budget under which half the blocks stream, from the engine's own plan inputs
        probe = StreamedEngine(source, LoraWeights(args, LoraSpec(), "cpu", seed=0), dtype=dtype)
        gpu_memory_budget = streaming_budget(args, **probe.plan_inputs(batches))
        probe.close()
        if gpu_memory_budget is None:
            raise ConfigError(
                f"--preset {preset}: no GPU memory budget streams half its blocks at this shape; "
                "give --gpu-memory-budget"
            )
        budget_kind = "the largest under which half the blocks stream (memory.streaming_budget)"
    spec = LoraSpec()
    head = {
        "preset": preset,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "device_name": device_name(device),
        "host": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "torch": torch.__version__,
        "dtype": dname,
        "base_quant": base_quant,
        "finetuning_type": finetuning_type,
        "compile_blocks": compile_blocks,
        "kernels": "fast" if compile_blocks else kernels,
        "dequant_kernels": _dequant_kernels(base_quant, device, dtype),
        "model": {**model_facts(args, dtype), "weight_bytes": weight_bytes},
        "lora": {  # the targets as this family reads them (Phi-3: the fused qkv and gate_up)
            "rank": spec.rank,
            "alpha": spec.alpha,
            "targets": list(resolve_targets(args, spec.targets)),
        },
        "gpu_memory_budget": gpu_memory_budget,
        "gpu_memory_budget_kind": budget_kind,
        "bandwidth": {
            "bytes_per_second": bandwidth,
            "kind": f"pinned host→device copy of {COPY_BYTES // MiB} MiB"
            if device.type == "cuda"
            else f"host memcpy of {COPY_BYTES // MiB} MiB; on a CPU the weights are read in "
            "place, so the streamed row's W/B is nominal",
        },
        "matmul": {"flops_per_second": matmul, "kind": f"{dname} ({n}, {n}) @ ({n}, {n})"},
        "memory_bandwidth": {
            "bytes_per_second": memory_bw,
            "kind": f"{'device' if device.type == 'cuda' else 'host'} copy of {COPY_BYTES // MiB} "
            "MiB, bytes read + written",
        },
    }
    rows: list[dict] = []
    for m in modes:
        # the streamed row runs under its budget's cap, as a trainer does; the others uncapped
        with gpu_memory_cap(device, gpu_memory_budget if m == "streamed" else None):
            rows.append(
                _run_mode(
                    m,
                    source,
                    batches,
                    shape,
                    device,
                    dtype,
                    gpu_memory_budget,
                    bandwidth,
                    matmul,
                    profile,
                    compile_blocks,
                    finetuning_type == "full",
                    kernels,
                )
            )
        if rows[-1]["fits"]:
            rows[-1]["floor_elementwise_seconds"] = (
                rows[-1]["elementwise_bytes_per_step"] / memory_bw
            )
        result = {
            **head,
            "shape": {**asdict(shape), "tokens_per_step": rows[0]["tokens_per_step"]},
            "modes": rows,
        }
        if on_row is not None:
            on_row(result)
    return result


def measure_memory_bandwidth(
    device: torch.device, nbytes: int = COPY_BYTES, reps: int = 5
) -> float:
    """Bytes/s through the device's own memory (HBM on a GPU, DRAM on a CPU): a copy of `nbytes`
    within it, counted read + written (2·nbytes), the best of `reps`. What the elementwise line
    divides by."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        best = min(cuda_copy_seconds(dst, src, reps))
    else:
        dst.copy_(src)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    del src, dst
    _release_cuda(device)
    return 2 * nbytes / best


def _dequant_kernels(base_quant: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """What dequantized the blocks: "triton" (quant/gpu.py's fused kernels), or "pytorch" (on a CPU,
    or where the Triton kernels did not load or launch: quant warned why); None unquantized."""
    if base_quant == "none":
        return None
    return "triton" if quant.gpu_dequantizers(device, dtype) is not None else "pytorch"
