"""`appliance plan`: memory, time and cost of a run, from config.json alone, before renting a GPU.

    appliance plan --preset 7b --gpu a10 --tokens 50000000
    appliance plan --model ./Llama-2-70b --gpu a10 --micro-batches-per-step auto --json

The run's shape (--seq-len, --micro-batch-size, --micro-batches-per-step, --lora-rank,
--base-quant) defaults to `train`'s (config.TrainConfig), so `plan --model X` describes
`train --model X`. What it computes, per trainer (one per GPU; `--gpus N` trainers share one
node's weight store):

- GPU memory by part, and which blocks stay resident: the engine's own planner
  (`memory.plan_memory`, what `StreamedEngine.plan` calls), fed with the bytes config.json
  implies instead of real tensors.
- Host memory: the weight store (shared memory, one per node), what page-locking registers, the
  saved activations offloaded to pinned host memory, the trainer and tokenizer processes.
- Time: host→device bytes per optimizer step (`memory.blocks_uploaded_per_step` blocks, both
  passes), FLOPs F (engine/flops.py, as the engine and the bench count them: the blocks' matmuls, LoRA,
  causal attention with the recompute, the LM head), the floor max(bytes/B, F/P) with B and P
  from hardware.GPUS, tokens/s at the floor, and the crossover T*; beside the floor, not in
  it, the step's least elementwise bytes over the card's memory bandwidth.
- Cost: hours at the floor × $ per GPU-hour (the class's on-demand instance, or --price-per-hour).
- Fits: GPU and host both, or what each needs against what there is and the flags that fix it
  (plan/fixes.py); the command exits 1 when it does not fit.

The floor is a lower bound: a real step takes longer (see docs/benchmarks.md for measured
ratios). Nothing here reads weights or needs a GPU.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.actors.tokenize_worker import MAX_DEFAULT_WORKERS
from appliance.config import TrainConfig, parse_bytes
from appliance.engine.flops import elementwise_bytes, lora_active_params, step_flops
from appliance.engine.memory import (
    MemoryPlan,
    blocks_uploaded_per_step,
    device_saved_bytes,
    effective_budget,
    gpu_budget_problem,
    plan_memory,
)
from appliance.errors import ConfigError
from appliance.hardware import gpus as hardware
from appliance.models import (
    HOST_GLOBALS,
    block_linears,
    expert_modules,
    first_layer_like,
    global_shapes,
    lora_experts,
    lora_modules,
    resolve_targets,
    state_bytes,
)
from appliance.models.hf_checkpoint import block_shapes, read_model_args, seq_len_problems
from appliance.models.layers import ModelArgs
from appliance.plan import experts, full
from appliance.quant import is_linear_weight, quantized_nbytes
from appliance.storage import uri as storage

GiB, MiB = 2**30, 2**20
BASE_QUANTS = ("none", "int8", "nf4")  # largest to smallest
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # --dtype: bytes per value
TRAIN = TrainConfig()  # train's defaults: the shape plan assumes unless told otherwise
AUTO_MAX_M = 256  # `auto` looks at M = 1 .. this
AUTO_SLACK = 1.10  # `auto`: within 10 % of compute-bound
# Host-side process sizes the plan assumes (not measured per run): a trainer process (torch, the
# CUDA context's host side, Ray worker) and a tokenizer worker (tokenizers + Ray worker).
TRAINER_PROCESS_BYTES = 3 * GiB
TOKENIZER_WORKER_BYTES = GiB // 2
TOKENIZER_WORKERS = MAX_DEFAULT_WORKERS  # the default count's upper bound


def smaller_quants(base_quant: str) -> tuple[str, ...]:
    """The --base-quant values that store the weights smaller than `base_quant` (none for nf4)."""
    return BASE_QUANTS[BASE_QUANTS.index(base_quant) + 1 :]


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


def block_bytes(args: ModelArgs, dtype_bytes: int, base_quant: str = "none") -> int:
    """One block as stored and uploaded, each tensor padded to 64 bytes (blocks.pack).

    Quantized (`--base-quant`), the linear projection weights take the quantizer's own layout
    (quant.quantized_nbytes: int8 codes + an fp32 scale per output row, or NF4 codes + an fp32
    absmax per 64 values); norms and biases stay in the compute dtype.
    """

    def one(i: int) -> int:
        total = 0
        for name, shape in block_shapes(args, i).items():
            if base_quant != "none" and is_linear_weight(name):
                total += quantized_nbytes(shape, base_quant)
            else:
                total += _pad64(math.prod(shape) * dtype_bytes)
        return total

    # the biggest block: blocks differ by kind in Qwen3.5 and Gemma 4 (the store and the slots
    # are sized by it)
    return max(one(i) for i in _kinds(args))


def _kinds(args: ModelArgs) -> list[int]:
    """One block of each shape (models.first_layer_like), and Gemma 4's KV-shared ones."""
    return sorted(
        {first_layer_like(args, i) for i in range(args.num_layers)} | {args.num_layers - 1}
    )


def globals_bytes(args: ModelArgs, dtype_bytes: int, device: bool = False) -> int:
    """Embeddings, final norm and (untied) LM head, in the compute dtype, and what a family adds
    (Gemma 4's per-layer embeddings); `device`: without what stays in host memory
    (models.HOST_GLOBALS: Gemma 4's per-layer table)."""
    n = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    extra = global_shapes(args)
    n += sum(math.prod(s) for k, s in extra.items() if not (device and k in HOST_GLOBALS))
    return (n + args.hidden_size) * dtype_bytes


def dequant_bytes(args: ModelArgs, dtype_bytes: int, base_quant: str = "none") -> int:
    """A quantized block's linear weights dequantized into the compute dtype, which the device
    holds while that block computes (DeviceWeights.dequant_bytes); 0 for an unquantized base. At
    70b NF4 this is 1.7 GB: without it the plan kept 35 blocks resident where the engine, on an
    H100 under 24 GiB, kept 31 (2026-11-27)."""
    if base_quant == "none":
        return 0
    return max(
        sum(
            math.prod(s) * dtype_bytes
            for n, s in block_shapes(args, i).items()
            if is_linear_weight(n)
        )
        for i in _kinds(args)
    )


def lora_param_count(args: ModelArgs, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters over all blocks: r·(in + out) per adapted module, times E for a MoE
    block's experts (LoraWeights' shapes); a block adapts the targets it has (Qwen3.5)."""
    modules = set(lora_modules(resolve_targets(args, targets)))
    return sum(
        rank * lora_experts(args, m) * sum(args.module_shape(m, i))
        for i in range(args.num_layers)
        for m in (*block_linears(args, i), *expert_modules(args))
        if m in modules
    )


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanInput:
    """What the plan is asked about (the CLI's flags, resolved)."""

    args: ModelArgs
    model: str  # the --model or --preset it came from, for the printout
    gpu: str  # a key of hardware.GPUS
    gpus: int = 1
    seq_len: int = TRAIN.seq_len
    micro_batch_size: int = TRAIN.micro_batch_size
    micro_batches_per_step: int | None = TRAIN.micro_batches_per_step  # None: auto
    base_quant: str = TRAIN.base_quant
    lora_rank: int = TRAIN.lora_rank
    lora_targets: tuple[str, ...] = tuple(TRAIN.lora_targets)
    gpu_memory_budget: int | None = None  # default: 90 % of the card, as the engine
    tokens: int | None = None
    steps: int | None = None
    price_per_hour: float | None = None  # $ per GPU-hour
    dtype_bytes: int = 2  # bf16 compute on a GPU
    h2d_bytes_per_second: float | None = None  # overrides the table's B (e.g. doctor's figure)
    flops_per_second: float | None = None  # overrides the table's P
    measured: hardware.Gpu | None = None  # this box's GPU, measured (train's auto M): not `gpu`
    train_defaults: tuple[str, ...] = ()  # the shape flags left at train's defaults (printout)
    finetuning_type: str = TRAIN.finetuning_type  # full: every weight trains (plan/full.py)
    freeze_embeddings: bool = False
    adamw_params_per_second: float | None = None  # measured (doctor); else full.ADAMW_...

    @property
    def full(self) -> bool:
        return self.finetuning_type == "full"

    @property
    def card(self) -> hardware.Gpu:
        card = self.measured or hardware.GPUS[self.gpu]
        if self.h2d_bytes_per_second:
            card = replace(card, h2d_bytes_per_second=self.h2d_bytes_per_second)
        if self.flops_per_second:
            card = replace(card, flops_per_second=self.flops_per_second)
        return card

    @property
    def budget(self) -> int:
        """What the engine's plan would take on an idle card (memory.effective_budget)."""
        total = self.card.memory_bytes
        return effective_budget(self.gpu_memory_budget, total, free=total, reserved=0)


def load_args(model: str | None, preset: str | None) -> tuple[ModelArgs, str]:
    """ModelArgs from --model's config.json (local or s3://; nothing else is read) or --preset."""
    if (model is None) == (preset is None):
        raise ConfigError("give one of --model DIR|s3://... or --preset NAME")
    if preset is not None:
        from appliance.models.presets import PRESETS

        if preset not in PRESETS:
            raise ConfigError(f"--preset {preset!r} is unknown; one of {', '.join(PRESETS)}")
        return PRESETS[preset].args, f"preset {preset}"
    if storage.is_s3(model):
        data = storage.read_bytes(storage.join(model, "config.json"))
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_bytes(data)
            return read_model_args(d), model
    return read_model_args(model), model


def plan_input(
    model: str | None,
    preset: str | None,
    gpu: str,
    micro_batches_per_step: str,
    gpu_memory_budget: str | None,
    *,
    gpus: int = 1,
    seq_len: int = TRAIN.seq_len,
    micro_batch_size: int = TRAIN.micro_batch_size,
    base_quant: str = TRAIN.base_quant,
    lora_rank: int = TRAIN.lora_rank,
    tokens: int | None = None,
    steps: int | None = None,
    price_per_hour: float | None = None,
    dtype: str = "bfloat16",
    h2d_gbps: float | None = None,
    tflops: float | None = None,
    train_defaults: tuple[str, ...] = (),
    finetuning_type: str = TRAIN.finetuning_type,
    freeze_embeddings: bool = False,
) -> PlanInput:
    """Check the CLI's flags (every problem at once, each naming its flag) and resolve them.
    `train_defaults`: the shape flags the user left at train's defaults, for the printout."""

    errors = []
    gpu = gpu.strip().lower()  # A10 is a10 (the table's keys are lower case)
    if gpu not in hardware.GPUS:
        errors.append(f"--gpu {gpu!r} is unknown; one of {'|'.join(hardware.GPUS)}")
    if base_quant not in BASE_QUANTS:
        errors.append(f"--base-quant {base_quant!r} must be one of {' | '.join(BASE_QUANTS)}")
    m: int | None = None
    if micro_batches_per_step != "auto":
        try:
            m = int(micro_batches_per_step)
        except ValueError:
            m = 0
        if m < 1:
            errors.append(
                f"--micro-batches-per-step must be ≥ 1 or auto (got {m or micro_batches_per_step!r})"
            )
    for flag, v in (
        ("--gpus", gpus),
        ("--seq-len", seq_len),
        ("--micro-batch-size", micro_batch_size),
        ("--lora-rank", lora_rank),
        ("--tokens", tokens),
        ("--steps", steps),
    ):
        if v is not None and v < 1:
            errors.append(f"{flag} must be ≥ 1 (got {v})")
    if tokens is not None and steps is not None:
        errors.append("--tokens and --steps are exclusive: give one")
    for flag, v in (("--h2d-gbps", h2d_gbps), ("--tflops", tflops)):
        if v is not None and v <= 0:
            errors.append(f"{flag} must be > 0 (got {v})")
    if dtype not in DTYPES:
        errors.append(f"--dtype {dtype!r} must be one of {' | '.join(DTYPES)}")
    if price_per_hour is not None and price_per_hour < 0:
        errors.append(f"--price-per-hour must be ≥ 0 (got {price_per_hour})")
    budget = None
    if gpu_memory_budget is not None:
        try:
            budget = parse_bytes(gpu_memory_budget)
        except ValueError as e:
            errors.append(f"--gpu-memory-budget: {e}")
        else:
            problem = gpu_budget_problem(gpu_memory_budget, budget)
            if problem:
                errors.append(problem)
    if finetuning_type == "full" and base_quant != "none":
        errors.append("--finetuning-type full trains every weight: give --base-quant none")
    if errors:
        raise ConfigError("\n".join(errors))
    args, label = load_args(model, preset)
    problems = seq_len_problems(args, seq_len)  # what train refuses, plan refuses alike
    if problems:
        raise ConfigError("\n".join(problems))
    return PlanInput(
        args,
        label,
        gpu,
        gpus=gpus,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        micro_batches_per_step=m,
        base_quant=base_quant,
        lora_rank=lora_rank,
        gpu_memory_budget=budget,
        tokens=tokens,
        steps=steps,
        price_per_hour=price_per_hour,
        dtype_bytes=DTYPES[dtype],
        h2d_bytes_per_second=h2d_gbps * 1e9 if h2d_gbps else None,
        flops_per_second=tflops * 1e12 if tflops else None,
        train_defaults=train_defaults,
        finetuning_type=finetuning_type,
        freeze_embeddings=freeze_embeddings,
    )


# ---------------------------------------------------------------- the plan


def memory_plan(p: PlanInput, micro_batches: int) -> MemoryPlan:
    """The engine's planner for one trainer running `micro_batches` micro-batches per step."""
    tokens = p.micro_batch_size * p.seq_len
    return plan_memory(
        p.args,
        dtype_bytes=p.dtype_bytes,
        budget=p.budget,
        tokens=micro_batches * tokens,
        biggest=tokens,
        block_bytes=block_bytes(p.args, p.dtype_bytes, p.base_quant),
        # as the engine counts them (StreamedEngine.plan_inputs): the globals, and a quantized
        # block's dequantized weights while it computes
        # (full fine-tuning: and the gradient buffers, FullFinetuneEngine.plan_inputs)
        globals_bytes=globals_bytes(p.args, p.dtype_bytes, device=True)
        + dequant_bytes(p.args, p.dtype_bytes, p.base_quant)
        + (full.gpu_grad_bytes(p.args, p.dtype_bytes, p.freeze_embeddings) if p.full else 0)
        # Gemma 4's state across blocks, per micro-batch, for the step (models.state_bytes)
        + micro_batches * state_bytes(p.args, p.micro_batch_size, p.seq_len, p.dtype_bytes),
        lora_params=0 if p.full else lora_param_count(p.args, p.lora_rank, p.lora_targets),
        longest=p.seq_len,
    )


def host_bytes(p: PlanInput, mem: MemoryPlan) -> dict[str, int]:
    """Host memory of one node running `p.gpus` trainers, by part (bytes)."""
    store = _pad64(globals_bytes(p.args, p.dtype_bytes)) + p.args.num_layers * mem.block_bytes
    offloaded = mem.activation_bytes if mem.offload_activations else 0
    parts = {
        "weight_store": store,  # in /dev/shm (Ray's object store), once per node
        "page_locked_per_trainer": p.args.num_layers * mem.block_bytes + offloaded,
        "offloaded_activations": p.gpus * offloaded,  # pinned, beside the store
        "trainer_processes": p.gpus * TRAINER_PROCESS_BYTES,
        "tokenizer_workers": TOKENIZER_WORKERS * TOKENIZER_WORKER_BYTES,
    }
    if p.full:  # fp32 masters, moments and gradients beside each trainer's CPU AdamW
        f = full.host_bytes(p.args, p.dtype_bytes, p.freeze_embeddings, p.gpus)
        parts["optimizer_state"] = f["master"] + f["moments"] + f["grad_buffers"]
    parts["shm_needed"] = store
    parts["ram_needed"] = (
        store
        + parts.get("optimizer_state", 0)
        + parts["offloaded_activations"]
        + parts["trainer_processes"]
        + parts["tokenizer_workers"]
    )
    return parts


def host_ram_bytes(p: PlanInput) -> int:
    """The host RAM the class's instance gives `p.gpus` trainers (its share when they are fewer
    than its GPUs)."""
    instance = p.card.instance
    return int(instance.host_ram_bytes * min(1.0, p.gpus / instance.gpus))


def evaluate(p: PlanInput, micro_batches: int) -> dict:
    """Every number of the plan at `micro_batches` micro-batches per trainer per step."""
    card, args, L = p.card, p.args, p.args.num_layers
    mem = memory_plan(p, micro_batches)
    tokens_per_trainer = micro_batches * p.micro_batch_size * p.seq_len
    uploads = (full.blocks_uploaded_per_step if p.full else blocks_uploaded_per_step)(
        L, mem.resident_blocks
    )
    # a MoE block streamed by expert moves its dense part and the experts routed to: the
    # expected share at this trainer's tokens per block pass (plan/experts.py)
    moe = experts.moe_share(args, p.base_quant, tokens_per_trainer)
    saved = experts.saved_bytes_per_copy(args, p.dtype_bytes, moe["expected_share_per_copy"]) if (
        moe and moe["streamed_by_expert"]) else 0  # fmt: skip
    streamed = uploads * (mem.block_bytes - saved)
    shapes = [(p.micro_batch_size, p.seq_len)] * micro_batches
    lora = 0 if p.full else lora_active_params(args, p.lora_rank, p.lora_targets)
    # a full fine-tune's head trains unless it is the tied input embedding, frozen
    head_trained = not (args.tie_word_embeddings and p.freeze_embeddings)
    parts = step_flops(args, shapes, lora_params=lora, full=p.full, head_trained=head_trained)
    flops = parts.total
    h2d_s, compute_s = streamed / card.h2d_bytes_per_second, flops / card.flops_per_second
    floor = max(h2d_s, compute_s)
    extra = {}
    if p.full:  # the gradients device→host (the link's other direction) and the CPU's AdamW
        rate = p.adamw_params_per_second or full.ADAMW_PARAMS_PER_SECOND
        costs = full.step_costs(args, p.freeze_embeddings, card.h2d_bytes_per_second, rate)
        seconds = {"host→device": h2d_s, "device→host": costs["d2h_seconds"],
                   "compute": compute_s, "cpu optimizer": costs["optimizer_seconds"]}  # fmt: skip
        floor = max(seconds.values())
        extra["full_finetune"] = {
            **costs,
            "trained_parameters": full.trained_params(args, p.freeze_embeddings),
            "host_bytes": full.host_bytes(args, p.dtype_bytes, p.freeze_embeddings, p.gpus),
            "gpu_grad_bytes": full.gpu_grad_bytes(args, p.dtype_bytes, p.freeze_embeddings),
            "binds": full.binds(seconds),
        }
    if moe is not None:
        extra["moe"] = moe
    tokens_per_step = p.gpus * tokens_per_trainer
    host = host_bytes(p, mem)
    host_fits = host["ram_needed"] <= host_ram_bytes(p)
    elementwise = elementwise_bytes(args, shapes, p.dtype_bytes)
    hbm = hardware.MEMORY_BYTES_PER_SECOND.get(p.gpu)
    per_token = flops / tokens_per_trainer  # at this shape (attention grows with seq_len)
    crossover = streamed * card.flops_per_second / (card.h2d_bytes_per_second * per_token)
    return {
        "micro_batches_per_step": micro_batches,
        "tokens_per_step": tokens_per_step,
        "fits": mem.fits and host_fits,
        "gpu_fits": mem.fits,
        "host_fits": host_fits,
        "resident_blocks": max(mem.resident_blocks, 0),
        "blocks": L,
        "offload_activations": mem.offload_activations,
        "block_bytes": mem.block_bytes,
        "gpu_budget_bytes": mem.budget,
        # the least budget that runs: mem.min_bytes, and the saved inputs' device slots
        "gpu_min_bytes": mem.min_bytes + device_saved_bytes(mem.activation_bytes, L, True),
        "gpu_bytes": mem.gpu_bytes(),
        "host_bytes": host,
        "host_ram_bytes": host_ram_bytes(p),
        "weight_store_bytes": host["weight_store"],
        "blocks_uploaded_per_step": uploads,
        "streamed_bytes_per_step": streamed,
        "flops_per_step": flops,
        "flops_by_part": parts.as_dict(),
        "elementwise_bytes_per_step": elementwise,
        "memory_bytes_per_second": hbm,
        "elementwise_seconds": elementwise / hbm if hbm else None,
        "h2d_bytes_per_second": card.h2d_bytes_per_second,
        "flops_per_second": card.flops_per_second,
        "h2d_seconds": h2d_s,
        "compute_seconds": compute_s,
        "step_seconds_floor": floor,
        "tokens_per_second": tokens_per_step / floor if floor > 0 else math.inf,
        "crossover_tokens_per_step": crossover,
        **extra,
    }


def choose_micro_batches(p: PlanInput) -> tuple[int, str]:
    """`--micro-batches-per-step auto`: the smallest M that fits with its floor within 10 % of
    compute-bound (h2d time ≤ 1.1 × compute time); if no M up to AUTO_MAX_M does, the fitting M
    with the most tokens/s. Returns (M, why)."""
    fitting = []
    for m in range(1, AUTO_MAX_M + 1):
        r = evaluate(p, m)
        if not r["fits"]:
            continue
        if r["step_seconds_floor"] <= AUTO_SLACK * r["compute_seconds"]:
            return m, "the smallest M within 10% of compute-bound that fits"
        fitting.append((r["tokens_per_second"], -m))
    if not fitting:
        return 1, "no M fits; showing M = 1"
    best = max(fitting)
    return -best[1], f"no M ≤ {AUTO_MAX_M} is within 10% of compute-bound; the fastest that fits"
