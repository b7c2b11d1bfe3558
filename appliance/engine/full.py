"""Full fine-tuning on the streamed step: every weight trains, AdamW on the host.

The step is StreamedEngine's (engine/step.py) with three changes:

1. The backward's recompute of block i takes the block's weights as autograd leaves, so it makes
   their gradients too; they add up over the step's micro-batches in fp32 on the device, then
   leave for the host (on CUDA on a side stream, into page-locked buffers) while block i−1
   computes. The head makes the final norm's and LM head's gradients, and after block 0 the
   embedding's gradient comes from each micro-batch's gradient w.r.t. block 0's input.
2. The optimizer is `host_adam.HostAdamW`: fp32 master weights and moments in host memory, one
   update per part (a block, or the globals), run by one worker thread beside the GPU work.
3. Each update writes the part's compute-dtype weights back into the host buffers the engine
   streams from (the weight store's writable home, or a copy of the source made here), and the
   next read of that part waits for its update (`_UpdatedWeights`), nothing else does.

Schedule (exact, the default): with gradient clipping by global norm (`grad_clip`) an update
needs the norm, so it waits for every gradient; the worker computes each part's norms as its
gradients land, and the updates run — globals, block 0, 1, ... — while the next step's forward
streams: block i's forward waits for block i's update only. Without clipping each block is
updated as soon as its gradients are on the host, overlapping the backward of the blocks below.
Both equal a plain full fine-tune (transformers + torch.optim.AdamW over the whole model, with
gradient accumulation over the same micro-batches): tests/engine/test_full_finetune.py. No
schedule that changes the numbers (a delayed or speculative update) is built.

`optimizer` (phase_seconds) is the time the step waited for updates; `optimizer_host_seconds`
the time the worker spent in them: the difference is the update time hidden behind the GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from appliance.engine.batches import MicroBatch, StepStats, count_targets
from appliance.engine.batches import micro_batches_of as _micro_batches
from appliance.engine.blocks import BlockSource, FlatBlockSource, pack
from appliance.engine.device_weights import SideStream, event_seconds
from appliance.engine.flops import step_flops
from appliance.engine.host_adam import GLOBALS, HostAdamW
from appliance.engine.step import StreamedEngine
from appliance.errors import ConfigError
from appliance.models import hf_checkpoint, layers
from appliance.quant import QuantizedTensor

EMBED = "model.embed_tokens.weight"


@dataclass
class FullStepStats(StepStats):
    """StepStats and what full fine-tuning adds."""

    optimizer_host_seconds: float = 0.0  # worker time in AdamW updates finished since last step
    d2h_bytes: int = 0  # fp32 weight gradients copied device→host (0 on a CPU: nothing moves)
    trained_parameters: int = 0


def family_problem(args) -> str | None:
    """Why this model's family cannot be fully fine-tuned here yet (None: it can). Mixtures of
    experts (their load-balancing loss and the router's gradient are not in this step) and
    Gemma 4 (its per-layer embeddings and the K/V shared across blocks are state this step does
    not carry) train LoRA only; tests/engine/test_full_finetune.py holds the others to a plain
    full fine-tune."""
    if args.num_experts:
        why = "a mixture of experts"
    elif args.architecture.startswith("Gemma4"):
        why = "Gemma 4 (per-layer embeddings, K/V shared across blocks)"
    else:
        return None
    return (
        f"--finetuning-type full: {args.architecture} is {why}, which trains LoRA adapters "
        "only for now; use --finetuning-type lora"
    )


def writable_source(source: BlockSource, dtype: torch.dtype) -> FlatBlockSource:
    """`source` as flat host buffers in `dtype` that the optimizer may write: itself when it
    already is one (the weight store's writable home), else a copy packed here (tests, eval)."""
    name = str(dtype).removeprefix("torch.")
    if (
        isinstance(source, FlatBlockSource)
        and all(
            isinstance(b, np.ndarray) and b.flags.writeable
            for b in [*source.global_bufs, *source.block_bufs]
        )
        and all(
            e[2] == name for ix in [*source.global_index, *source.block_index] for e in ix.values()
        )
    ):
        return source
    g = source.globals()
    blocks = [source.block(i) for i in range(source.num_blocks)]
    if any(isinstance(t, QuantizedTensor) for b in blocks for t in b.values()):
        raise ConfigError(
            "--finetuning-type full trains every weight: a quantized base (--base-quant) cannot "
            "be trained; use --base-quant none"
        )
    gbufs = [pack({k: t.to(dtype)}) for k, t in g.items()]
    bbufs = [pack({k: t.to(dtype) for k, t in b.items()}) for b in blocks]
    return FlatBlockSource(
        source.args,
        [b for b, _ in gbufs],
        [ix for _, ix in gbufs],
        [b for b, _ in bbufs],
        [ix for _, ix in bbufs],
    )


class _UpdatedWeights:
    """The engine's DeviceWeights, whose reads of a part first wait for that part's pending
    update (and then drop the device copy made before it): everything else passes through."""

    def __init__(self, weights, engine: FullFinetuneEngine):
        self._w, self._engine = weights, engine

    def __getattr__(self, name):
        return getattr(self._w, name)

    @property
    def globals(self) -> dict[str, torch.Tensor]:
        self._engine._settle(GLOBALS)
        return self._w.globals

    def get(self, i: int) -> dict[str, torch.Tensor]:
        self._engine._settle(str(i))
        return self._w.get(i)

    def prefetch(self, i: int) -> None:
        if 0 <= i < self._w.source.num_blocks:
            self._engine._settle(str(i))
        self._w.prefetch(i)


class FullFinetuneEngine(StreamedEngine):
    """Trains every weight of a model streamed block by block (module docstring).

    `freeze_embeddings`: the input embeddings do not train (with tied embeddings that is the LM
    head too). `adamw`: torch's CPU AdamW implementation ("fused", "foreach", "single")."""

    def __init__(
        self,
        source: BlockSource,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        gpu_memory_budget: int | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float | None = 1.0,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        freeze_embeddings: bool = False,
        adamw: str = "fused",
        copy_blocks: bool = False,
        compile_blocks: bool = False,
    ):
        if dtype == torch.float16:
            raise ConfigError(
                "--finetuning-type full: float16 compute is not supported (no loss scaling of "
                "weight gradients); use --dtype bfloat16 or float32"
            )
        if problem := family_problem(source.args):
            raise ConfigError(problem)
        source = writable_source(source, dtype)
        super().__init__(
            source,
            None,
            device=device,
            dtype=dtype,
            gpu_memory_budget=gpu_memory_budget,
            grad_clip=grad_clip,
            seed=seed,
            group=group,
            copy_blocks=copy_blocks,
            compile_blocks=compile_blocks,
        )
        self.source = source
        frozen = {EMBED} if freeze_embeddings else set()
        parts = {GLOBALS: source.globals()}
        parts.update({str(i): source.block(i) for i in range(source.num_blocks)})
        # ranks of a group share their node's weights: each keeps its own fp32 masters
        self.host = HostAdamW(parts, betas=betas, eps=eps, weight_decay=weight_decay, impl=adamw,
                              frozen=frozen, alias=group is None)  # fmt: skip
        self.weights = _UpdatedWeights(self.weights, self)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-adamw")
        self._pending: dict[str, Future] = {}  # part → its update, until a read waits for it
        self._norms: dict[str, Future] = {}  # part → its gradients' norms (clipping)
        self._grads: dict[str, dict[str, torch.Tensor]] = {}  # part → host fp32 gradients
        self._host_grads: dict[str, dict[str, torch.Tensor]] = {}  # CUDA: page-locked, reused
        self._d2h = SideStream(self.device)
        self._d2h_bytes = 0
        self._wait_seconds = 0.0  # time reads waited for updates (the exposed optimizer)

    def close(self) -> None:
        self.settle()
        self._worker.shutdown()
        super().close()

    # ------------------------------------------------------------ updates

    def _settle(self, part: str) -> None:
        """Wait for `part`'s pending update, then drop its stale device copy (CUDA, or a CPU
        that copies blocks); the next read copies the updated weights."""
        future = self._pending.pop(part, None)
        if future is None:
            return
        t0 = time.perf_counter()
        future.result()
        self._wait_seconds += time.perf_counter() - t0
        w = self.weights._w
        if part != GLOBALS:
            w.reload(int(part))
        elif w.copies:
            for k, t in self.host.trains(GLOBALS).items():
                if w.globals[k].data_ptr() != t.data_ptr():
                    w.globals[k].copy_(t)

    def settle(self) -> None:
        """Wait for every pending update (before reading the weights or the optimizer state)."""
        for part in [GLOBALS, *(str(i) for i in range(self.args.num_layers))]:
            self._settle(part)

    def _land(self, part: str, acc: dict[str, torch.Tensor]) -> None:
        """`part`'s fp32 gradients, accumulated on the device: summed over the data-parallel
        group, copied to the host (CUDA: on the side stream), then its norms queued (clipping)
        or its update (no clipping) on the worker."""
        trains = self.host.trains(part)
        for k, t in trains.items():  # a rank without micro-batches contributes zeros
            if k not in acc:
                acc[k] = torch.zeros(t.shape, dtype=torch.float32, device=self.device)
        if self.group is not None and acc:
            flat = torch.cat([acc[k].reshape(-1) for k in trains])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for k in trains:
                n = acc[k].numel()
                acc[k] = flat[offset : offset + n].view_as(acc[k])
                offset += n
        done = None
        if self.device.type == "cuda":
            host = self._host_grads.setdefault(part, {})
            with self._d2h.copying():
                self._d2h.wait_for_compute()
                for k, g in acc.items():
                    if k not in host:
                        host[k] = torch.empty(g.shape, dtype=torch.float32, pin_memory=True)
                    host[k].copy_(g, non_blocking=True)
                    self._d2h_bytes += g.numel() * 4
                done = self._d2h.event()
                done.record()
            grads, keep = host, acc  # the device buffers live until the copy is done
        else:
            grads, keep = acc, None
        self._grads[part] = grads

        def landed() -> None:
            if done is not None:
                done.synchronize()

        self._norms[part] = self._worker.submit(_norms_after, landed, grads, keep)
        if not self.grad_clip:  # nothing to wait for: the update follows the norms job (one
            # worker, in order), which waited for the copy
            self._pending[part] = self._worker.submit(
                _update_after, lambda: None, self.host, part, grads, self._lr, 1.0, None
            )

    def _clip_and_update(self) -> float:
        """The global gradient norm (before clipping), as clip_grad_norm_ makes it: per-tensor
        norms in the model's parameter order (embeddings, blocks, final norm, LM head), their
        norm; then every part's update queued, globals first, with the clipping coefficient."""
        norms = {p: self._norms.pop(p).result() for p in self._grads}
        glob = norms.pop(GLOBALS)
        flat = [glob.pop(EMBED)] if EMBED in glob else []
        flat += [n for i in range(self.args.num_layers) for n in norms[str(i)].values()]
        flat += list(glob.values())  # the final norm, then the LM head
        total = torch.linalg.vector_norm(torch.stack(flat)) if flat else torch.zeros(())
        if self.grad_clip:
            coef = float(torch.clamp(self.grad_clip / (total + 1e-6), max=1.0))
            for part in [GLOBALS, *(str(i) for i in range(self.args.num_layers))]:
                self._pending[part] = self._worker.submit(
                    _update_after, lambda: None, self.host, part, self._grads[part], self._lr,
                    coef, None,
                )  # fmt: skip
        self._grads.clear()
        return float(total)

    # ------------------------------------------------------------ the step

    def forward_backward(self, micro_batches, step: int, first: int = 0):
        raise NotImplementedError("full fine-tuning: call train_step (the update is its part)")

    def train_step(self, micro_batches: list[MicroBatch], lr: float, first: int = 0) -> StepStats:
        """One optimizer step (StreamedEngine.train_step's contract): the updates are queued
        when it returns; reads of the weights wait for them."""
        micro_batches = _micro_batches(micro_batches)
        t0 = time.perf_counter()
        self._lr = lr
        self._wait_seconds = 0.0
        self._d2h_bytes = 0
        self.weights.clear_timings()
        self._busy_events.clear()
        self._lag.anchor()
        self._plan_for(micro_batches)
        L, dev = self.args.num_layers, self.device
        n_target = count_targets(micro_batches)
        labels = [mb.labels.to(dev) for mb in micro_batches]
        if self.group is not None:
            count = torch.tensor([n_target], dtype=torch.int64, device=dev)
            dist.all_reduce(count, group=self.group)
            n_target = int(count)
        denom = max(n_target, 1)
        loss = torch.zeros((), device=dev)
        attn = [self._attention_inputs(mb) for mb in micro_batches]
        g = self.weights.globals  # waits for the globals' update
        leaves = {
            k: v.detach().requires_grad_(k in self.host.trains(GLOBALS)) for k, v in g.items()
        }
        acc_globals: dict[str, torch.Tensor] = {}
        grads: list[torch.Tensor] = []
        if micro_batches:
            hs = self._forward(micro_batches, step=self.step_count, dropout=False, save=True,
                               first=first, attn=attn)  # fmt: skip
            with self._busy():
                for h, lab in zip(hs, labels, strict=True):
                    part, grad = self._head(h, lab, leaves, denom, acc_globals)
                    loss += part
                    grads.append(grad)
            del hs
            self.weights.prefetch(L - 1)
            self.saved.prefetch(L - 1)
        t1 = time.perf_counter()
        forward_stall = self.weights.stall_seconds()
        forward_host, forward_wait = self.weights.host_seconds, self._wait_seconds
        for i in reversed(range(L)):
            acc: dict[str, torch.Tensor] = {}
            if micro_batches:
                self._block_backward(i, micro_batches, attn, grads, first, acc)
            self._land(str(i), acc)
        if micro_batches and EMBED in self.host.trains(GLOBALS):
            with self._busy():
                for mb, grad in zip(micro_batches, grads, strict=True):
                    e = layers.embed(mb.ids.to(dev), leaves, self.args.embed_scale)
                    e.backward(grad)
                    _accumulate(leaves, acc_globals)
        del grads
        self._land(GLOBALS, acc_globals)
        if self.group is not None:
            dist.all_reduce(loss, group=self.group)
        norm = self._clip_and_update()
        self._sync()
        t2 = time.perf_counter()
        self.step_count += 1
        w = self.weights.take_timings()
        stall = w["h2d_stall"] + self.saved.take_stall_seconds()
        wait = self._wait_seconds
        phases = {
            "forward": t1 - t0 - forward_stall - forward_host - forward_wait,
            "backward": t2 - t1 - (stall - forward_stall) - (w["h2d_host"] - forward_host)
            - (wait - forward_wait),
            "h2d_stall": stall,
            "h2d_host": w["h2d_host"],
            "optimizer": wait,
        }  # fmt: skip
        tokens = sum(mb.ids.numel() for mb in micro_batches)
        busy = ratio = None
        if dev.type == "cuda":  # compute-stream spans: blocks' micro-batches, head, embedding
            busy = event_seconds(self._busy_events)
            ratio = busy / (t2 - t0)
        self._busy_events.clear()
        return FullStepStats(
            loss=float(loss),
            tokens=tokens,
            target_tokens=n_target,
            grad_norm=norm,
            phase_seconds=phases,
            h2d_bytes=w["h2d_bytes"],
            offload_h2d_bytes=self.saved.take_h2d_bytes(),
            h2d_seconds=w["h2d_seconds"],
            gpu_busy_seconds=busy,
            gpu_busy_ratio=ratio,
            issue_lag=self._lag.take(),
            step_seconds=t2 - t0,
            flops=self.flops_per_step(micro_batches),
            optimizer_host_seconds=self.host.take_seconds(),
            d2h_bytes=self._d2h_bytes,
            trained_parameters=self.host.num_parameters(),
        )

    def _head(self, h, labels, leaves, denom, acc) -> tuple[torch.Tensor, torch.Tensor]:
        """layers.loss_and_grad with the final norm and LM head as leaves: (this micro-batch's
        loss / denom, its gradient w.r.t. `h`); their gradients add into `acc` in fp32."""
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)
        for c in layers.head_chunks(h, self.args.vocab_size):
            hc = h[:, c].detach().requires_grad_(True)
            part = layers.loss_sum(hc, labels[:, c], leaves, self.args) / denom
            part.backward()
            loss += part.detach()
            grad[:, c] = hc.grad
            _accumulate(leaves, acc)
        return loss, grad

    def _block_backward(self, i, micro_batches, attn, grads, first, acc) -> None:
        """Recompute + backward of block i for every micro-batch with its weights as leaves:
        `grads[m]` becomes the gradient w.r.t. block i's input; the weights' gradients add up
        into `acc` (fp32)."""
        w = self.weights.get(i)
        self.weights.prefetch(i - 1)
        inputs = self.saved.take(i)
        self.saved.prefetch(i - 1)
        leaves = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        lora = self.lora.context(i, self.dtype)
        with self._busy(lag=("backward", i)):
            for m in range(len(micro_batches)):
                x = inputs[m].detach().requires_grad_(True)
                inputs[m] = None
                cos, sin, mask = self._block_inputs(attn[m], x.shape[1], i)
                y = self._block(x, leaves, self.args, cos, sin, lora, mask, layer=i)
                y.backward(grads[m])
                grads[m] = x.grad
                _accumulate(leaves, acc)
        self.saved.done(i)
        if i > 0:
            self.weights.release(i)

    def flops_per_step(self, micro_batches: list[MicroBatch]) -> float:
        """F with every weight's gradient (engine/flops.py: 8·N·T; the head's too if it trains)."""
        shapes = [tuple(mb.ids.shape) for mb in micro_batches]
        # the head trains unless it is the (tied) input embedding, frozen
        head = not self.args.tie_word_embeddings or EMBED in self.host.trains(GLOBALS)
        return step_flops(self.args, shapes, full=True, head_trained=head).total

    def plan_inputs(self, micro_batches: list[MicroBatch]) -> dict:
        """StreamedEngine's, with the device's gradient buffers counted as fixed bytes: the
        globals' fp32 gradients, two blocks' fp32 gradients (one accumulating, one copying out)
        and one block's gradient in the compute dtype (a micro-batch's, before it is added)."""
        inputs = super().plan_inputs(micro_batches)
        inputs["globals_bytes"] += self.grad_buffer_bytes()
        return inputs

    def grad_buffer_bytes(self) -> int:
        block = sum(t.numel() for t in self.source.block(0).values())
        glob = sum(t.numel() for t in self.host.trains(GLOBALS).values())
        return glob * 4 + block * (2 * 4 + self.dtype.itemsize)

    # ------------------------------------------------------------ weights and state

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its checkpoint name (compute dtype, host views of the store),
        after the pending updates."""
        self.settle()
        out = dict(self.source.globals())
        for i in range(self.args.num_layers):
            names = hf_checkpoint.block_names(self.args, i)
            block = self.source.block(i)
            prefix = f"model.layers.{i}."
            out.update({n: block[n[len(prefix) :]] for n in names})
        return out

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Start over from `named` (checkpoint name → tensor, every weight): the store and the
        masters take them, AdamW's moments go, the step count is 0."""
        self.settle()
        parts = {GLOBALS: {k: named[k] for k in self.source.globals()}}
        for i in range(self.args.num_layers):
            prefix = f"model.layers.{i}."
            parts[str(i)] = {k: named[prefix + k] for k in self.source.block(i)}
        self.host.reset(parts)
        self.step_count = 0
        self._reload_device()

    def _reload_device(self) -> None:
        """Every device copy made before the host weights changed goes (CUDA, or copy_blocks)."""
        w = self.weights._w
        for i in range(self.args.num_layers):
            w.reload(i)
        if w.copies:
            for k, t in self.source.globals().items():
                if w.globals[k].data_ptr() != t.data_ptr():
                    w.globals[k].copy_(t)

    def state_dict(self) -> dict:
        self.settle()
        return {"host_adamw": self.host.state_dict(), "step": self.step_count}

    def part_state(self, part: str) -> dict:
        """One part's masters and AdamW state (HostAdamW.part_state), after pending updates."""
        self.settle()
        return self.host.part_state(part)

    def load_part_state(self, part: str, state: dict) -> None:
        """Restore one part (HostAdamW.load_part; ValueError for another model's); call
        loaded_parts when every part is back."""
        self.settle()
        self.host.load_part(part, state)

    def loaded_parts(self, step: int) -> None:
        """Every part restored (load_part_state): the step count, and the device's copies."""
        self.step_count = int(step)
        self._reload_device()

    def load_state_dict(self, state: dict) -> None:
        """ValueError (one line) when `state` is not a full fine-tune's, or another model's."""
        if "host_adamw" not in state:
            raise ValueError("the optimizer state is not a full fine-tune's (a LoRA run's?)")
        self.settle()
        self.host.load_state_dict(state["host_adamw"])
        self.step_count = int(state["step"])
        self._reload_device()


def _accumulate(leaves: dict[str, torch.Tensor], acc: dict[str, torch.Tensor]) -> None:
    """Move each leaf's gradient into `acc` in fp32 (the first one as it is, then added in
    place: the sum autograd's own accumulation makes), and clear it."""
    for k, t in leaves.items():
        if t.grad is None:
            continue
        if k in acc:
            acc[k] += t.grad
        else:
            acc[k] = t.grad.float()
        t.grad = None


def _norms_after(landed, grads: dict[str, torch.Tensor], keep) -> dict[str, torch.Tensor]:
    """The 2-norm of each gradient (fp32), once they have landed on the host."""
    landed()
    del keep
    return {k: torch.linalg.vector_norm(g, 2.0) for k, g in grads.items()}


def _update_after(landed, host: HostAdamW, part, grads, lr, scale, keep) -> None:
    landed()
    del keep
    host.update(part, grads, lr, scale)
