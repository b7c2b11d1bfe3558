"""The streamed LoRA step: layer-major forward, head, reverse layer-major recompute + backward.

For a global batch of M micro-batches and a model of L blocks (docs/architecture.md, "The streamed step"):

1. Forward, layer-major, under no_grad: block i's weights are made resident on the device once,
   then every micro-batch runs through it; each micro-batch's input to block i is saved.
2. Head: final norm, LM head, fp32 loss (summed NLL / target tokens of the whole global batch),
   and the gradient w.r.t. the last hidden states.
3. Backward, reverse layer-major: block i is recomputed from its saved input with grad enabled
   (dropout masks come from a generator seeded by (seed, step, block, micro-batch), so the
   recompute draws the forward's masks exactly), then backpropagated with the incoming gradient.
   LoRA gradients accumulate over micro-batches into fp32 leaves.
4. AdamW on the fp32 LoRA parameters, after gradient clipping.

float16 compute adds dynamic loss scaling (`loss_scale.LossScaler`): step 2 seeds the backward
with loss·scale, step 4 unscales the fp32 LoRA gradients first and skips the update when one is
not finite (after the data-parallel all-reduce, so every rank skips the same steps).

Data parallel (`group=`): each rank runs steps 1–3 on its share of the global batch (possibly
none); the target-token count is summed over ranks before the head, and the LoRA gradients and
the loss after the backward (one flat all-reduce), so step 4 is identical on every rank.

Weights come from a `BlockSource` (host tensors) through `device_weights.DeviceWeights`: on CUDA it
copies block i±1 on a side stream from page-locked memory while block i computes, keeps the
blocks that fit the memory budget resident, and measures the copies; on CPU every path reduces to
plain tensor access. No Ray here: the engine is tested on its own against a full-model reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time

import torch
import torch.distributed as dist

from appliance import models
from appliance.engine.batches import (
    SIZES,
    MicroBatch,
    StepStats,
    batch_sizes,
    count_targets,
    micro_batches_of,
)
from appliance.engine.blocks import BlockSource
from appliance.engine.device_weights import DeviceWeights, event_seconds, with_index
from appliance.engine.flops import lora_active_params, step_flops
from appliance.engine.issue_lag import IssueLag
from appliance.engine.loss_scale import LossScaler
from appliance.engine.memory import CUDA_MARGIN_BYTES, effective_budget, plan_memory
from appliance.engine.saved_inputs import SavedInputs
from appliance.errors import ConfigError
from appliance.models import layers, rope
from appliance.models.lora import LoraSpec, LoraWeights
from appliance.models.moe import LoadBalance


class StreamedEngine:
    """Trains LoRA adapters on a frozen model streamed block by block (see module docstring)."""

    def __init__(
        self,
        source: BlockSource,
        lora: LoraWeights | None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        gpu_memory_budget: int | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float | None = 1.0,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        loss_scaler: LossScaler | None = None,
        copy_blocks: bool = False,
        compile_blocks: bool = False,
        expert_streaming: bool = True,
        kernels: str = "exact",
    ):
        """`group`: a data-parallel process group. Each rank passes its share of the global batch
        to `train_step`; target tokens, LoRA gradients and the loss are summed over the group, so
        every rank applies the same update. Without a group the engine is single-process.

        `lora=None`: the base model alone, for `eval_loss` and `logits` (no optimizer; training
        methods refuse).

        `loss_scaler`: float16 training scales its loss (module docstring); None takes a default
        LossScaler then. Other dtypes have no scaler and refuse one.

        `copy_blocks` (CPU): copy blocks into streaming slots as on CUDA instead of reading them in
        place (DeviceWeights' `copies`): the tests' way to run the GPU path's bookkeeping here.
        `compile_blocks`: run the blocks through torch.compile (models.compiled_block_forward).
        `kernels`: "exact" (bitwise transformers + PEFT) or "fast" (LoRA's shared-input A's
        as one matmul: LoraWeights.context); with `compile_blocks` the tier is fast either way
        (`self.kernels` says which ran).
        `expert_streaming`: a MoE model's streamed blocks cross by expert, only the experts its
        tokens were routed to (engine/expert_streaming.py); False: whole blocks."""
        self.args = source.args
        self.group = group
        self.device = with_index(torch.device(device))  # "cuda" → the current CUDA device
        self.dtype = dtype
        # no adapters: an empty LoraWeights, whose per-block contexts add nothing
        self.lora = lora if lora is not None else LoraWeights(self.args, LoraSpec(targets=()))
        self.seed = seed
        self.grad_clip = grad_clip
        self.budget = gpu_memory_budget
        if loss_scaler is not None and dtype != torch.float16:
            raise ValueError(f"loss scaling is for float16 compute, not {dtype}")
        experts = models.expert_layout(self.args) if expert_streaming else None
        self.weights = DeviceWeights(source, self.device, dtype, copy_blocks, experts)
        self.optimizer = None
        if lora is not None:
            self.optimizer = torch.optim.AdamW(
                lora.parameters(),
                lr=0.0,
                betas=betas,
                weight_decay=weight_decay,
                foreach=self.device.type == "cuda",
            )
        fp16 = dtype == torch.float16 and lora is not None
        self.scaler = (loss_scaler or LossScaler()) if fp16 else None
        self.step_count = 0
        self._busy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._issue_seconds = 0.0  # host time issuing work in forward_backward
        self._lag = IssueLag(self.device)  # each block's GPU lag behind its issue (CUDA)
        self._sized_for: dict[str, int] = {}  # the batch sizes the plan holds (none yet)
        self._rope: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.saved = SavedInputs(self.device, self.args.num_layers)
        self._block = models.compiled_block_forward if compile_blocks else models.block_forward
        if kernels not in ("exact", "fast"):
            raise ValueError(f"kernels {kernels!r}: exact or fast")
        self.kernels = "fast" if compile_blocks else kernels
        # compiled blocks keep one A per projection: the stacked product's cache is Python state
        self._lora_kernels = "exact" if compile_blocks else kernels

    def close(self) -> None:
        """Unregister page-locked host memory and free device weights (DeviceWeights.close,
        SavedInputs.close)."""
        self.weights.close()
        self.saved.close()

    def __enter__(self) -> StreamedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ planning

    def plan(self, micro_batches: list[MicroBatch]) -> None:
        """Decide which blocks stay resident and where saved activations live (CUDA only).

        Sized for `micro_batches` (the biggest global batch to come), and for any bigger batch
        planned before; a step or eval whose batch the plan does not hold plans again (_plan_for).
        ConfigError if even streaming every block does not fit the budget.
        """
        micro_batches = micro_batches_of(micro_batches)
        inputs = self.plan_inputs(micro_batches)
        for k in SIZES:  # never smaller than a batch already planned for
            inputs[k] = max(inputs[k], self._sized_for.get(k, 0))
        self._sized_for = {k: inputs[k] for k in SIZES}
        if self.device.type != "cuda":
            return
        L = self.args.num_layers
        free, total = torch.cuda.mem_get_info(self.device)
        budget = effective_budget(self.budget, total, free, torch.cuda.memory_reserved(self.device))
        p = plan_memory(self.args, budget=budget, **inputs)
        if not p.fits:
            raise ConfigError(
                f"--gpu-memory-budget: {budget / 2**30:.1f} GiB usable (the budget, at most the "
                f"{free / 2**30:.1f} GiB the GPU has free, less {CUDA_MARGIN_BYTES / 2**30:.2f} GiB "
                f"for CUDA) is too small for this model and micro-batch: at least "
                f"{(p.min_bytes + CUDA_MARGIN_BYTES) / 2**30:.1f} GiB needed; lower "
                "--micro-batch-size or --seq-len, or raise the budget"
            )
        # the last blocks of forward are the first of backward: they stay; the others stream
        # through the plan's fixed slots
        self.weights.configure(set(range(L - p.resident_blocks, L)), p.streaming_slots or 2)
        if p.offload_activations:  # page-locked host room for the biggest global batch, once
            self.saved.allocate(inputs["tokens"], self.args.hidden_size, self.dtype)
        else:
            self.saved.close()  # kept on the device (a plan before this one may have offloaded)

    def _plan_for(self, micro_batches: list[MicroBatch]) -> None:
        """Plan (again) if the plan does not hold `micro_batches`: none was made yet, or one was
        made for a smaller batch (an eval's before the first, bigger, training step)."""
        if not micro_batches:
            return
        sizes = batch_sizes(micro_batches)
        if not self._sized_for or any(sizes[k] > self._sized_for[k] for k in SIZES):
            self.plan(micro_batches)

    def plan_inputs(self, micro_batches: list[MicroBatch]) -> dict:
        """What `plan` tells memory.plan_memory besides the budget: the bytes this engine holds
        and the batch it is sized for (also what bench asks for a budget that streams)."""
        micro_batches = micro_batches_of(micro_batches)
        w = self.weights
        return dict(
            dtype_bytes=self.dtype.itemsize,
            **batch_sizes(micro_batches),
            block_bytes=w.block_bytes(),
            # the globals, a quantized block's dequantized weights while it computes, and the
            # packed documents' masks, kept for a whole step
            globals_bytes=sum(t.numel() * t.element_size() for t in w.globals.values())
            + w.dequant_bytes()
            + self._mask_bytes(micro_batches)
            + sum(
                models.state_bytes(self.args, *mb.ids.shape, self.dtype.itemsize)
                for mb in micro_batches
            ),
            lora_params=self.lora.num_parameters(),
        )

    def _cos_sin(self, T: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for T positions; `local`: Gemma 3's sliding layers' (ModelArgs.local_rope)."""
        if (T, local) not in self._rope:
            self._rope[T, local] = rope.rope_cos_sin(self.args, T, self.device, self.dtype, local)
        return self._rope[T, local]

    def _attention_inputs(self, mb: MicroBatch) -> tuple[torch.Tensor | None, object, dict, object]:
        """(positions, mask, RoPE tables by `local`, block state) for one micro-batch, once per
        pass: plain causal rows (None, None); packed documents their per-row positions and the
        document mask: a flex_attention BlockMask on CUDA where the block runs layers.attention
        (the Llama family), a boolean (B, 1, T, T) mask otherwise (layers.attend takes that).
        The block state (models.block_state: Gemma 4's per-layer inputs and shared K/V, None
        for the other families) is what this micro-batch's blocks share for the pass."""
        g, host = self.weights.globals, self.weights.host_globals
        state = models.block_state(self.args, mb.ids, g, host, self.device, self.dtype)
        if mb.packing is None:
            return None, None, {}, state
        positions, segments = (t.to(self.device) for t in mb.packing)
        if self.device.type == "cuda" and models.takes_block_mask(self.args):
            return positions, layers.document_block_mask(segments), {}, state
        return positions, layers.document_mask(segments), {}, state

    def _mask_bytes(self, micro_batches: list[MicroBatch]) -> int:
        """Device bytes of the boolean (B, 1, T, T) document masks `_attention_inputs` makes for
        a pass's packed micro-batches (a BlockMask, where one replaces them, is small)."""
        if self.device.type == "cuda" and models.takes_block_mask(self.args):
            return 0
        packed = [mb.ids.shape for mb in micro_batches if mb.packing is not None]
        return sum(B * T * T for B, T in packed)

    def _block_inputs(
        self, attn: tuple, T: int, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(cos, sin, mask) for block i of a micro-batch: the RoPE table that block takes
        (ModelArgs.local_rope: Gemma 3's sliding layers have their own), gathered per row at the
        packed documents' positions (computed once per table and pass)."""
        positions, mask, tables, _ = attn
        local = self.args.local_rope(i)
        if local not in tables:
            cos, sin = self._cos_sin(T, local)
            tables[local] = (cos, sin) if positions is None else rope.rope_at(cos, sin, positions)
        return (*tables[local], mask)

    def _generator(self, step: int, i: int, m: int) -> torch.Generator | None:
        """Dropout masks for block i of micro-batch m (its index in the GLOBAL batch, so that any
        split over data-parallel ranks draws the masks one engine would) at optimizer step
        `step`; the recompute in backward asks again and gets the same masks."""
        if self.lora.spec.dropout <= 0:
            return None
        key = f"{self.seed},{step},{i},{m}".encode()  # stable across processes and Pythons
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return torch.Generator(device=self.device).manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)

    # ------------------------------------------------------------ the step

    def _forward(
        self,
        micro_batches: list[MicroBatch],
        step: int,
        dropout: bool,
        save: bool,
        first: int = 0,
        attn: list | None = None,
        balance: LoadBalance | None = None,
    ) -> list[torch.Tensor]:
        """Layer-major forward under no_grad. Returns the last hidden states.
        `save` (training): keep each block's inputs in `self.saved`, and the last block on the
        device for the backward; otherwise (eval, logits) every streamed block is released.
        `first`: the global-batch index of micro_batches[0] (this rank's offset). `attn`: the
        micro-batches' `_attention_inputs`, when the caller keeps them for its backward.
        `balance`: observes each MoE block's router logits (the load-balancing loss)."""
        L = self.args.num_layers
        g = self.weights.globals
        self.weights.drop_streamed(keep=0)  # what a pass that raised left in the slots
        self.weights.forget_routing()  # the backward prefetches what this pass routes to
        with torch.no_grad():
            with self._busy():
                hs = [
                    layers.embed(mb.ids.to(self.device), g, self.args.embed_scale)
                    for mb in micro_batches
                ]
                if attn is None:
                    attn = [self._attention_inputs(mb) for mb in micro_batches]
            if save:
                self.saved.start_step([h.shape for h in hs])
            for i in range(L):
                w = self.weights.get(i)
                self.weights.prefetch(i + 1)
                with self._busy(lag=("forward", i)):
                    lora = self.lora.context(
                        i, self.dtype, dropout=None if dropout else 0.0, kernels=self._lora_kernels
                    )
                    for m, h in enumerate(hs):
                        if save:
                            self.saved.save(i, h)
                        lora.generator = self._generator(step, i, first + m)
                        cos, sin, mask = self._block_inputs(attn[m], h.shape[1], i)
                        lg = None if balance is None else []  # the routers' logits
                        state = attn[m][3]  # Gemma 4: its per-layer inputs, shared K/V
                        hs[m] = self._block(h, w, self.args, cos, sin, lora, mask, layer=i,
                                            router_logits=lg, state=state)  # fmt: skip
                        if lg:
                            balance.observe(lg)
                if i + 1 < L or not save:
                    self.weights.release(i)  # in training the last block stays: backward's first
                # a quantized block's dequantized weights go before the next block's are made
                # (the plan counts one block's)
                del w
        return hs

    def forward_backward(
        self, micro_batches: list[MicroBatch], step: int, first: int = 0
    ) -> tuple[float, int, dict]:
        """Accumulate LoRA gradients for one global batch; returns (loss, target tokens, seconds).

        With a data-parallel group, `micro_batches` is this rank's share (possibly empty) and the
        returned loss, target tokens and the LoRA gradients are those of the whole global batch.
        Call it once per optimizer step then: the gradients are summed over ranks in place.
        """
        micro_batches = micro_batches_of(micro_batches)
        if self.optimizer is None:
            raise ValueError("this engine was built with lora=None: it evaluates, it cannot train")
        self._plan_for(micro_batches)
        L = self.args.num_layers
        g = self.weights.globals
        # the step's timings start here: what an eval or logits call recorded since the last step
        # (its weight copies, stalls, busy spans) is not this step's
        self.weights.clear_timings()
        self._busy_events.clear()
        n_target = count_targets(micro_batches)  # before the labels move: no device sync
        labels = [mb.labels.to(self.device) for mb in micro_batches]
        if self.group is not None:  # every rank divides by the global batch's target tokens
            count = torch.tensor([n_target], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, group=self.group)
            n_target = int(count)
        denom = max(n_target, 1)
        t0 = time.perf_counter()
        loss = torch.zeros((), device=self.device)
        # positions, document masks and RoPE tables: made once, for the forward and the backward
        with self._busy():
            attn = [self._attention_inputs(mb) for mb in micro_batches]
        balance = LoadBalance.of(self.args)  # the load-balancing loss, if config.json asks
        if micro_batches:
            hs = self._forward(micro_batches, step, True, True, first, attn, balance)
            # head: this share's part of the global batch's loss, and d(loss)/d(last hidden states)
            grads = []
            with self._busy():
                for h, lab in zip(hs, labels, strict=True):
                    scale = 1.0 if self.scaler is None else self.scaler.scale
                    part, grad = layers.loss_and_grad(h, lab, g, self.args, denom, scale)
                    loss += part
                    grads.append(grad)
            del hs
        if balance is not None:  # this rank's share of it, of the global batch's counts
            loss += balance.loss(self.group).to(loss.device)
        if micro_batches:
            self.weights.prefetch(L - 1)
            self.saved.prefetch(L - 1)
        self._issue_seconds = time.perf_counter() - t0
        self._sync()
        t1 = time.perf_counter()
        forward_stall = self.weights.stall_seconds()
        forward_host = self.weights.host_seconds
        if micro_batches:
            for i in reversed(range(L)):
                w = self.weights.get(i)
                self.weights.prefetch(i - 1)
                inputs = self.saved.take(i)
                self.saved.prefetch(i - 1)  # block i-1's inputs come back while block i computes
                with self._busy(lag=("backward", i)):
                    # with grad: one cast on the tape, one add per micro-batch back (lora_pass)
                    lora = self.lora.context(i, self.dtype, kernels=self._lora_kernels)
                    for m in range(len(micro_batches)):
                        x = inputs[m].detach().requires_grad_(True)
                        inputs[m] = None  # free the saved input as soon as it is consumed
                        lora.generator = self._generator(step, i, first + m)
                        cos, sin, mask = self._block_inputs(attn[m], x.shape[1], i)
                        lg = None if balance is None else []
                        state = attn[m][3]  # Gemma 4: also its store blocks' K/V
                        y = self._block(x, w, self.args, cos, sin, lora, mask, layer=i,
                                        router_logits=lg, state=state)  # fmt: skip
                        roots, root_grads = models.backward_roots(y, grads[m], state)
                        aux = None if balance is None else balance.part(lg or [])
                        if aux is not None:  # the block's share of the load-balancing loss
                            scale = 1.0 if self.scaler is None else self.scaler.scale
                            roots, root_grads = [*roots, aux * scale], [*root_grads, None]
                        torch.autograd.backward(roots, root_grads)
                        grads[m] = x.grad
                    del lora, x
                self.saved.done(i)
                if i > 0:
                    self.weights.release(i)  # block 0 stays: it is the first of the next forward
                del w  # as in the forward: one block's dequantized weights at a time
        if self.group is not None:
            loss = self._all_reduce_grads_and(loss)
        self._issue_seconds += time.perf_counter() - t1
        self._sync()
        t2 = time.perf_counter()
        # compute's waits for host→device copies: the weights' and the offloaded block inputs'
        stall = self.weights.stall_seconds() + self.saved.take_stall_seconds()
        backward_stall = stall - forward_stall
        backward_host = self.weights.host_seconds - forward_host
        # phases must not overlap: the time compute waited for a host→device copy is h2d_stall
        # and the time the host was blocked staging weights is h2d_host, neither is compute; the
        # gradient all-reduce counts as backward
        phases = {
            "forward": t1 - t0 - forward_stall - forward_host,
            "backward": t2 - t1 - backward_stall - backward_host,
            "h2d_stall": stall,
        }
        return float(loss), n_target, phases

    def _all_reduce_grads_and(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum every LoRA gradient and `loss` over the group: one flat fp32 buffer, one collective.

        A rank with no micro-batches has no gradients yet: it contributes zeros."""
        params = self.lora.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.reshape(1).to(torch.float32)])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return flat[-1]

    def optimizer_step(self, lr: float) -> tuple[float, bool]:
        """Clip, then AdamW; returns (gradient norm before clipping, whether the step was
        skipped). With a loss scaler (float16) the gradients are unscaled first, and a non-finite
        norm skips the update (parameters and AdamW state untouched) and backs the scale off."""
        params = self.lora.parameters()
        if self.scaler is not None:
            self.scaler.unscale_(params)
        if self.grad_clip:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        skipped = self.scaler is not None and not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(finite=not skipped)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def train_step(self, micro_batches: list[MicroBatch], lr: float, first: int = 0) -> StepStats:
        """One optimizer step over `micro_batches` (the global batch, or this rank's share of it,
        which starts at index `first` of the global batch: dropout masks follow the global index).

        GPU busy time (CUDA only; None on CPU): `gpu_busy_seconds` sums, over the step, the
        compute-stream time between CUDA events bracketing real work: the embedding; each block's
        micro-batches in the forward and in the backward, from after the stream has waited for
        that block's weights (so h2d stalls are excluded) to after its last micro-batch; a
        quantized block's dequantization; the head; and clipping + AdamW. Not counted: waits for
        weights, the data-parallel all-reduce, and any time outside the engine (data wait,
        logging). Limits: a bracket counts its whole span, so gaps inside it where the GPU idled
        because the host was slow to launch kernels count as busy; and "busy" means the stream
        was working, not that the SMs were full.
        `host_issue_seconds` (CUDA only) reads that limit: the host's wall time up to each point
        where it waits for the GPU; near step_seconds, the step is launch-bound.
        `gpu_busy_ratio` = gpu_busy_seconds / step_seconds (this method's own wall time); a
        trainer that also waits for data should divide by its longer step time instead.
        """
        micro_batches = micro_batches_of(micro_batches)
        t0 = time.perf_counter()
        scale = None if self.scaler is None else self.scaler.scale  # before the step updates it
        self._lag.anchor()
        loss, n_target, phases = self.forward_backward(micro_batches, self.step_count, first)
        t1 = time.perf_counter()
        with self._busy():
            norm, skipped = self.optimizer_step(lr)
        issue = self._issue_seconds + time.perf_counter() - t1
        self._sync()
        t2 = time.perf_counter()
        self.step_count += 1
        w = self.weights.take_timings()
        phases["optimizer"] = t2 - t1
        phases["h2d_host"] = w["h2d_host"]
        busy = ratio = None
        if self.device.type == "cuda":
            # dequantizing runs on the compute stream between the brackets (weights.get)
            busy = event_seconds(self._busy_events) + w["dequant"]
            ratio = busy / (t2 - t0)
        self._busy_events.clear()
        tokens = sum(mb.ids.numel() for mb in micro_batches)
        return StepStats(
            loss=loss,
            tokens=tokens,
            target_tokens=n_target,
            grad_norm=norm,
            phase_seconds=phases,
            h2d_bytes=w["h2d_bytes"],
            expert_share=w["expert_share"],
            offload_h2d_bytes=self.saved.take_h2d_bytes(),
            h2d_seconds=w["h2d_seconds"],
            dequant_seconds=w["dequant"],
            gpu_busy_seconds=busy,
            gpu_busy_ratio=ratio,
            host_issue_seconds=issue if self.device.type == "cuda" else None,
            issue_lag=self._lag.take(),
            step_seconds=t2 - t0,
            flops=self.flops_per_step(micro_batches),
            loss_scale=scale,
            skipped_step=skipped,
        )

    def flops_per_step(self, micro_batches: list[MicroBatch]) -> float:
        """F of the floor for these micro-batches (engine/flops.py: blocks, LoRA, attention, head)."""
        shapes = [tuple(mb.ids.shape) for mb in micro_batches]
        spec = self.lora.spec
        n = lora_active_params(self.args, spec.rank, spec.targets) if spec.targets else 0
        return step_flops(self.args, shapes, lora_params=n).total

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> tuple[float, int]:
        """(summed NLL, predicted tokens) without dropout or gradients."""
        micro_batches = micro_batches_of(micro_batches)
        self._plan_for(micro_batches)
        self.weights.clear_timings()  # an eval's copies and waits are not reported: no pile-up
        self._busy_events.clear()
        hs = self._forward(micro_batches, step=0, dropout=False, save=False)
        # summed on the device in fp64 (as Python floats would) and read once: no sync per batch
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for h, mb in zip(hs, micro_batches, strict=True):
            total += layers.loss_sum(h, mb.labels.to(self.device), self.weights.globals, self.args)
        return float(total), count_targets(micro_batches)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits (B, T, vocab) in fp32, for parity tests and export checks."""
        ids = input_ids.to(self.device)
        batch = [MicroBatch(ids, ids)]  # (the labels are not read)
        self._plan_for(batch)
        self.weights.clear_timings()
        hs = self._forward(batch, step=0, dropout=False, save=False)
        return layers.logits(hs[0], self.weights.globals, self.args)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step_count}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint without a loss scale (before float16 had one, or another dtype's)
        leaves this engine's scaler as it is."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _busy(self, lag: tuple[str, int] | None = None):
        """Bracket compute-stream work with CUDA events (train_step sums them); no-op on CPU.
        `lag` (pass, block): the end event also marks that block's issue (issue_lag.py)."""
        if self.device.type != "cuda":
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._busy_events.append((start, end))
        if lag is not None:
            self._lag.mark(*lag, end)
