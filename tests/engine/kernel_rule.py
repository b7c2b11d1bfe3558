"""The fast kernels' accuracy rule (docs/architecture.md, "Two tiers of kernels"), as test
helpers: what a `--kernels fast` piece must keep to be allowed.

- Per block: its output, its input gradient and each LoRA gradient no further from an fp64
  reference than 3× the exact bf16 path's error (the root-mean-square error, as PyTorch's own
  bf16 rule in `torch._dynamo.utils.same` measures it, with its slack of tol/10 for tol 1e-4).
- Per step: the loss within 1e-3 relative of the exact path's, the gradient norm within 1%.
- Run to run: the fast path gives the same numbers twice, bit for bit.
"""

from __future__ import annotations

import torch

from appliance import models
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.models import rope
from appliance.models.lora import LoraWeights

MULTIPLIER = 3.0  # torch._dynamo.utils.same's for bf16
SLACK = 1e-5  # its tol / 10, tol 1e-4
LOSS_RTOL = 1e-3
GRAD_NORM_RTOL = 0.01


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean((a.double() - b.double()) ** 2)))


def block_results(
    args,
    w: dict[str, torch.Tensor],
    lora: LoraWeights,
    layer: int,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    dtype: torch.dtype,
    kernels: str,
    block=models.block_forward,
) -> list[torch.Tensor]:
    """[output, input gradient, every LoRA gradient] of block `layer` in `dtype` (the weights,
    input and output gradient cast from `w`, `x`, `grad_out`)."""
    wd = {k: v.to(dtype) for k, v in w.items()}
    xg = x.to(dtype).requires_grad_(True)
    cos, sin = rope.rope_cos_sin(
        args, x.shape[1], torch.device("cpu"), dtype, args.local_rope(layer)
    )
    ctx = lora.context(layer, dtype, kernels=kernels)
    y = block(xg, wd, args, cos, sin, ctx, layer=layer)
    y.backward(grad_out.to(dtype))
    params = [p for ab in lora.blocks[layer].values() for p in ab]
    out = [y.detach(), xg.grad] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def block_errors(
    args, w: dict[str, torch.Tensor], lora: LoraWeights, layer: int, seed: int = 0, block=None
) -> tuple[list[float], list[float]]:
    """(exact bf16's errors, fast bf16's errors) from the fp64 reference, per quantity
    (output, input gradient, each LoRA gradient); `w` holds the bf16 weights both use. `block`:
    the fast block function (models.compiled_block_forward: with one A per projection, as the
    engine runs compiled blocks); by default the eager block with the fast LoRA kernels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 12, args.hidden_size, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(2, 12, args.hidden_size, generator=g).to(torch.bfloat16)
    run = dict(args=args, w=w, lora=lora, layer=layer, x=x, grad_out=grad_out)
    ref = block_results(**run, dtype=torch.float64, kernels="exact")
    exact = block_results(**run, dtype=torch.bfloat16, kernels="exact")
    fast_kw = dict(kernels="fast") if block is None else dict(kernels="exact", block=block)
    fast = block_results(**run, dtype=torch.bfloat16, **fast_kw)
    return [rmse(e, r) for e, r in zip(exact, ref, strict=True)], [
        rmse(f, r) for f, r in zip(fast, ref, strict=True)
    ]


def assert_block_within_rule(exact_err: list[float], fast_err: list[float]) -> None:
    names = ["output", "input gradient"] + [f"LoRA gradient {j}" for j in range(len(fast_err) - 2)]
    for name, e, f in zip(names, exact_err, fast_err, strict=True):
        assert f <= MULTIPLIER * e + SLACK, f"{name}: fast {f:.3g} vs exact {e:.3g} from fp64"


def step_results(
    source: DictBlockSource, make_lora, micro_batches, kernels: str, **engine
) -> tuple[float, float, list[torch.Tensor]]:
    """(loss, gradient norm, every LoRA gradient) of one step's forward and backward."""
    lora = make_lora()
    eng = StreamedEngine(source, lora, dtype=torch.bfloat16, kernels=kernels, **engine)
    loss, _, _ = eng.forward_backward(micro_batches, step=0)
    grads = [p.grad for p in lora.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    return loss, norm, grads


def assert_step_within_rule(exact: tuple, fast: tuple) -> None:
    (loss_e, norm_e, _), (loss_f, norm_f, _) = exact, fast
    assert abs(loss_f - loss_e) <= LOSS_RTOL * abs(loss_e), (loss_f, loss_e)
    assert abs(norm_f - norm_e) <= GRAD_NORM_RTOL * norm_e, (norm_f, norm_e)
