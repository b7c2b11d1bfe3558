"""What the two peer baselines share (benchmarks/peer_fsdp2_offload.py, peer_hf_peft.py).

The peers train what `appliance bench` trains, so their rows compare with its streamed and
resident rows (benchmarks/compare.py):

- the model: `transformers.LlamaForCausalLM` of a preset's shape (appliance/models/presets.py), made on
  the meta device and then filled with the bench's own synthetic weights
  (`appliance.bench.step.SyntheticBlockSource`: N(0, 0.02) tiled from one pool at a stable offset
  per tensor, norms 1): the same weights, in seconds even for 13B;
- LoRA: r16, alpha 32, dropout 0 on q, k, v, o, gate, up, down (`appliance.models.lora.LoraSpec`'s
  defaults) through PEFT, fp32 adapters started from the bench's own adapters
  (`LoraWeights(seed=0)`: A ~ PEFT's kaiming bound, B = 0);
- the tokens: `appliance.bench.step._batches` (seeded random ids) at the preset's GPU shape on CUDA
  or its CPU shape on a CPU: micro_batches × micro_batch_size × seq_len tokens per step;
- the step: each micro-batch's mean cross-entropy over its seq_len targets / micro_batches,
  backward, gradients clipped to norm 1, AdamW (lr 1e-4, betas (0.9, 0.999), weight decay 0),
  as the engine does; bf16 compute on CUDA, fp32 on a CPU;
- gradient checkpointing on every decoder layer (transformers' own, non-reentrant);
- the timing: `warmup` untimed steps, then `steps` timed ones (wall time, the device
  synchronized at both ends of each step). `step_seconds` is the mean, as the bench's
  `step_seconds` is (so compare.py puts like with like); the median, the minimum and every step's
  time are in the JSON too. Peak GPU memory is `torch.cuda.max_memory_allocated` over the whole
  run (model build included).

A shape that does not fit (GPU or host memory) gives `fits: false` and the reason, not a crash.
Nothing here imports Ray or boto3 (the GPU machine has neither).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from appliance.actors.trainer import resolve_device
from appliance.bench.step import LR, _batches, _release_cuda, model_facts
from appliance.bench.synthetic import SyntheticBlockSource
from appliance.engine.device_weights import with_index
from appliance.hardware.measure import device_name, host_memory_available
from appliance.models import param_count
from appliance.models.layers import ModelArgs
from appliance.models.lora import LoraSpec, LoraWeights
from appliance.models.presets import PRESETS, Shape

GiB = 2**30


class DoesNotFit(Exception):
    """A peer's build found the shape cannot run here (the message says why): `fits: false`."""


GRAD_CLIP = 1.0  # the engine's default (StreamedEngine(grad_clip=1.0))
LLAMA_PRESETS = [k for k, p in PRESETS.items() if p.args.architecture == "LlamaForCausalLM"]

# ---------------------------------------------------------------- the model


def llama_config(args: ModelArgs):
    """The transformers LlamaConfig of a preset's ModelArgs (rope_theta/rope_scaling are read by
    transformers 4.45+ and 5.x alike)."""
    import transformers

    if args.architecture != "LlamaForCausalLM":
        raise ValueError(f"{args.architecture}: the peers build Llama shapes only")
    scaling = None
    if args.rope_scaling is not None:
        scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in args.rope_scaling}
        scaling.setdefault("rope_type", "llama3")  # ModelArgs: no rope_type means llama3
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=args.max_position_embeddings,
        attention_bias=args.attention_bias,
        mlp_bias=args.mlp_bias,
        tie_word_embeddings=args.tie_word_embeddings,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def lora_spec() -> LoraSpec:
    """r16, alpha 32, dropout 0, the 7 projections: the bench's LoRA (LoraSpec's defaults)."""
    return LoraSpec()


def peft_lora_config(spec: LoraSpec):
    import peft

    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=[m.rsplit(".", 1)[-1] for m in spec.modules],
        bias="none",
    )


def build_meta_model(args: ModelArgs, dtype: torch.dtype) -> torch.nn.Module:
    """PeftModel(LlamaForCausalLM) on the meta device: base weights in `dtype`, LoRA in fp32,
    gradient checkpointing (non-reentrant) on every decoder layer. Nothing is allocated."""
    import peft
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(args))
    model.to(dtype)
    # transformers 5.x renamed gradient checkpointing (the old names, which PEFT calls too, stay
    # until v6 with a FutureWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft_lora_config(lora_spec()))
    for name, p in model.named_parameters():
        if "lora_" in name:  # PEFT upcasts adapters of a bf16 base; make it explicit
            p.data = p.data.to(torch.float32)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own memory: a DTensor's local shard (the whole tensor at world size 1)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.shape != t.shape:
        raise RuntimeError(f"expected an unsharded tensor (world size 1), got {local.shape}")
    return local


def base_key(name: str) -> tuple[str, int]:
    """A base weight's name in the PeftModel → (bench key, block index; -1 for the globals):
    `base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight` → (
    `self_attn.q_proj.weight`, 3); `base_model.model.lm_head.weight` → (`lm_head.weight`, -1)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if name.startswith("model.layers."):
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        return rest, int(i)
    return name, -1


def lora_key(name: str) -> str:
    """A LoRA parameter's name in the PeftModel → its key in a PEFT adapter file (and in
    `LoraWeights.peft_state_dict`): the adapter name `.default` removed."""
    return name.replace(".default.", ".")


@torch.no_grad()
def fill_weights(model: torch.nn.Module, args: ModelArgs, compute_device: torch.device) -> None:
    """Give a `to_empty` model the bench's weights and adapters and fresh RoPE tables.

    Base weights: `SyntheticBlockSource._fill`, the very values the bench trains. LoRA: the
    bench's `LoraWeights(seed=0)`. The rotary embeddings' `inv_freq` buffers (not parameters, so
    left as garbage by `to_empty`) are rebuilt on `compute_device`.
    """
    dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
    source = SyntheticBlockSource(args, dtype)
    lora = LoraWeights(args, lora_spec(), "cpu", seed=0).peft_state_dict()
    for name, p in model.named_parameters():
        t = _local(p)
        if "lora_" in name:
            t.copy_(lora.pop(lora_key(name)))
        else:
            key, i = base_key(name)
            # `_fill` writes in place from the source's pool: no block buffer kept around
            source._fill(t, key, i)
    if lora:
        raise RuntimeError(f"LoRA tensors not in the model: {sorted(lora)[:3]}")
    if args.tie_word_embeddings:
        model.get_base_model().tie_weights()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq"):
                with torch.device(compute_device):
                    setattr(parent, child_name, type(child)(config=child.config))


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def lora_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA parameters as fp32 CPU copies, by their PEFT adapter-file key."""
    return {
        lora_key(n): _local(p).detach().to("cpu", torch.float32, copy=True)
        for n, p in lora_parameters(model).items()
    }


# ---------------------------------------------------------------- the run


@dataclass
class Setup:
    """What the command line asked for, resolved: preset, device, dtype, the step's shape."""

    preset: str
    args: ModelArgs
    device: torch.device
    dtype: torch.dtype
    shape: Shape


def resolve(preset: str, device: str = "auto", steps: int | None = None, warmup: int | None = None):
    """The preset's shape for the device (its GPU shape on CUDA, its CPU shape on a CPU, as the
    bench picks), bf16 on CUDA / fp32 on a CPU. ValueError, naming the flag, if it cannot run."""
    if preset not in LLAMA_PRESETS:
        raise ValueError(f"--preset {preset!r}: one of {', '.join(LLAMA_PRESETS)} (Llama shapes)")
    dev = torch.device(resolve_device(device))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is visible to torch here")
        dev = with_index(dev)  # torch.cuda.set_device and the device mesh want an index
    p = PRESETS[preset]
    default = p.gpu if dev.type == "cuda" else p.cpu
    if default is None:
        raise ValueError(f"--preset {preset} needs a GPU (--device cuda), as `appliance bench`")
    shape = Shape(
        default.micro_batch_size,
        default.seq_len,
        default.micro_batches,
        default.steps if steps is None else steps,
        default.warmup if warmup is None else warmup,
    )
    if shape.steps < 1 or shape.warmup < 0:
        raise ValueError(f"--steps must be ≥ 1 and --warmup ≥ 0, got {shape.steps}, {shape.warmup}")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return Setup(preset, p.args, dev, dtype, shape)


@dataclass
class Peer:
    """One peer system, as the shared loop drives it.

    `build(setup)` returns the trained module, its optimizer and a dict of facts for the JSON;
    `micro_batch(model, k, last)` runs before micro-batch k of a step (FSDP2 turns gradient sync
    off for all but the last); `autocast`: run forward under torch.autocast in the compute dtype
    (transformers' Trainer with bf16=True does)."""

    system: str
    label: str
    build: Callable[[Setup], tuple[torch.nn.Module, torch.optim.Optimizer, dict]]
    micro_batch: Callable[[torch.nn.Module, int, bool], None] | None = None
    autocast: bool = False
    setup_context: Callable[[Setup], object] = field(default=lambda setup: nullcontext())


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW on the LoRA parameters as the engine's: weight decay 0, betas (0.9, 0.999); the
    multi-tensor kernels where the parameters are on a GPU (FSDP2's offloaded ones are not)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=LR,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        foreach=all(p.device.type == "cuda" for p in params),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(
    peer: Peer,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    setup: Setup,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], list[float]]:
    """warmup + steps optimizer steps over `batches`; (losses of every step, timed seconds)."""
    dev, n = setup.device, len(batches)
    batches = [(x.to(dev), y.to(dev)) for x, y in batches]
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = peer.autocast and setup.dtype != torch.float32
    amp = torch.autocast(dev.type, dtype=setup.dtype) if mixed else nullcontext()
    model.train()
    losses, seconds = [], []
    for s in range(setup.shape.warmup + setup.shape.steps):
        _sync(dev)
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for k, (x, y) in enumerate(batches):
            if peer.micro_batch is not None:
                peer.micro_batch(model, k, k == n - 1)
            with amp:
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / n
            loss.backward()
            total += loss.detach()
            del logits, loss
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # reads the loss: the step's work is done
        _sync(dev)
        if s >= setup.shape.warmup:
            seconds.append(time.perf_counter() - t0)
    return losses, seconds


def _oom_reason(e: BaseException) -> str:
    where = "host" if isinstance(e, MemoryError) else "GPU"
    first = (str(e).splitlines() or [type(e).__name__])[0]
    return f"{where} out of memory: {first}"


def _versions() -> dict:
    import peft
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def check_host_memory(setup: Setup, pinned: bool = False) -> None:
    """DoesNotFit if the base weights do not fit in host memory (more than 90% of what is
    available, the bench's own check). `pinned`: each weight is page-locked on its own through
    torch's pinned-memory allocator (FSDP2's CPUOffloadPolicy on CUDA), which rounds every
    allocation up to a power of two: 13B's 24 GiB of bf16 then takes 41 GiB."""
    from appliance.models.hf_checkpoint import expected_shapes

    size = setup.dtype.itemsize
    if pinned:
        shapes = expected_shapes(setup.args).values()
        need = sum(1 << max(0, (math.prod(s) * size - 1).bit_length()) for s in shapes)
    else:
        need = param_count(setup.args) * size
    available = host_memory_available()
    if available is not None and need > 0.9 * available:
        kept = " page-locked (each rounded up to a power of two)" if pinned else ""
        raise DoesNotFit(
            f"host memory: the {str(setup.dtype).removeprefix('torch.')} weights{kept} need "
            f"{need / GiB:.1f} GiB, {available / GiB:.1f} GiB is available"
        )


def run_peer(peer: Peer, setup: Setup, keep_model: bool = False) -> tuple[dict, dict]:
    """Build, train and time one peer; (the JSON result, extras).

    `extras` (for tests): with `keep_model`, "model" and "lora_before" (the adapters before the
    first step). A `torch.cuda.OutOfMemoryError` or `MemoryError` anywhere gives `fits: false`
    with the reason; the memory is freed before returning."""
    dev, shape = setup.device, setup.shape
    batches = _batches(setup.args, shape)
    spec = lora_spec()
    result: dict = {
        "system": peer.system,
        "label": peer.label,
        "preset": setup.preset,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.type,
        "device_name": device_name(dev),
        **_versions(),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "model": model_facts(setup.args, setup.dtype),
        "lora": {
            "rank": spec.rank,
            "alpha": spec.alpha,
            "dropout": spec.dropout,
            "targets": list(spec.targets),
            "params": LoraWeights(setup.args, spec).num_parameters(),
        },
        "gradient_checkpointing": True,
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": 0.0, "grad_clip": GRAD_CLIP},
        "shape": {**asdict(shape), "tokens_per_step": sum(x.numel() for x, _ in batches)},
    }
    extras: dict = {}
    if dev.type == "cuda":
        _release_cuda(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    reason = model = optimizer = None
    with peer.setup_context(setup):
        try:
            t0 = time.perf_counter()
            model, optimizer, facts = peer.build(setup)
            result.update(facts)
            result["build_seconds"] = time.perf_counter() - t0
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            result["trainable_params"] = sum(
                p.numel() for p in model.parameters() if p.requires_grad
            )
            result["trainable_all_lora"] = all("lora_" in n for n in trainable)
            before = lora_snapshot(model)
            # gradient checkpointing recomputes each layer's forward in the backward: the first
            # layer's attention (inside the checkpointed call) counted
            calls = [0]
            attn = model.get_base_model().model.layers[0].self_attn
            hook = attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            losses, seconds = train_steps(peer, model, optimizer, setup, batches)
            hook.remove()
            after = lora_snapshot(model)
            result["attention_calls_per_micro_batch"] = calls[0] / (
                shape.micro_batches * (shape.warmup + shape.steps)
            )
            result["lora_tensors"] = len(before)
            result["lora_tensors_changed"] = sum(
                not torch.equal(before[k], after[k]) for k in before
            )
            if keep_model:
                extras.update(model=model, lora_before=before)
        except DoesNotFit as e:
            reason = str(e)
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            reason = _oom_reason(e)
        model = optimizer = None  # the traceback is gone with the except block: all is freed
    if reason is not None:
        _release_cuda(dev)
        result.update(fits=False, reason=reason)
        result["peak_gpu_bytes"] = (
            torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        )
        return result, extras
    step = statistics.mean(seconds)
    result.update(
        fits=True,
        reason=None,
        step_seconds=step,
        step_seconds_median=statistics.median(seconds),
        step_seconds_min=min(seconds),
        step_seconds_all=seconds,
        tokens_per_second=result["shape"]["tokens_per_step"] / step,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None,
        losses=losses,
    )
    if not keep_model:
        _release_cuda(dev)
    return result, extras


# ---------------------------------------------------------------- output and command line


def format_row(result: dict) -> str:
    """One line for the terminal (compare.py makes the table)."""
    s = result["shape"]
    head = (
        f"{result['label']}: preset {result['preset']} on {result['device_name']}, "
        f"{result['dtype']}, {s['micro_batches']}×{s['micro_batch_size']}×{s['seq_len']} = "
        f"{s['tokens_per_step']} tokens/step"
    )
    if not result["fits"]:
        return f"{head}: does not fit ({result['reason']})"
    peak = result["peak_gpu_bytes"]
    mem = f", peak GPU {peak / GiB:.2f} GiB" if peak is not None else ""
    return (
        f"{head}: step {result['step_seconds']:.4g} s (mean of {s['steps']}; median "
        f"{result['step_seconds_median']:.4g}), {result['tokens_per_second']:.4g} tokens/s{mem}; "
        f"losses {', '.join(f'{x:.4f}' for x in result['losses'])}"
    )


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--preset", choices=LLAMA_PRESETS, default="tiny", help="Model shape. [tiny]")
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto takes CUDA when a GPU is visible. [auto]",
    )
    ap.add_argument("--steps", type=int, default=None, metavar="N", help="Timed steps. [preset's]")
    ap.add_argument(
        "--warmup", type=int, default=None, metavar="N", help="Untimed steps first. [preset's]"
    )
    ap.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="Write JSON.")
    return ap


def main(peer: Peer, argv: list[str] | None, prog: str, description: str) -> int:
    a = parser(prog, description).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        setup = resolve(a.preset, a.device, a.steps, a.warmup)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result, _ = run_peer(peer, setup)
    print(format_row(result))
    if a.json_path:
        write_json(result, a.json_path)
    return 0
