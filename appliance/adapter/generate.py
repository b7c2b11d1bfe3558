"""`appliance generate`: a base model and an adapter (or a merged export) answer prompts.

Each prompt is rendered as one user turn with the chat template (the model's, or
--chat-template NAME|FILE; raw text with --no-chat-template or when the model has none) and the
model continues it, greedily or by sampling (--temperature, --top-p, --seed), until an end token
(the model's EOS, and the template's end-of-turn tokens the tokenizer has) or --max-new-tokens.

The prompts go through the model together, layer-major, as training goes: for each step, block
i's weights come to the device once and every prompt's new token passes through them, so a
model that does not fit on the device is streamed block by block (engine/device_weights.py: its
page-locked host buffers, prefetch on a side stream, fixed slots), one weight pass per generated
token for the whole batch. Each block keeps its keys and values across steps (models/kv_cache.py)
on the device, or, when the budget has no room for them, in host memory. A model that fits stays
resident. Prompts of different lengths share one cache: each row's padding is never attended, so
every row is decoded as if alone (tests/adapter/test_generate.py compares the tokens with
transformers + PEFT greedy decoding). One exception: Phi-3's longrope takes its long factors
when the batch's longest sequence passes original_max_position_embeddings, where transformers
decides for each prompt alone, so a short prompt batched with a long one may decode differently
(only past that length: 4096 tokens for the released models). Qwen3.5, Gemma 4 and gpt-oss are
refused by name for now (`family_problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.actors.weight_store import local_source
from appliance.data.chat import ChatTemplate
from appliance.data.records import load_tokenizer
from appliance.engine.device_weights import DeviceWeights
from appliance.engine.memory import CUDA_MARGIN_BYTES, effective_budget
from appliance.errors import ConfigError
from appliance.models import block_forward, hf_checkpoint, layers, rope
from appliance.models.kv_cache import KVCache, Positions
from appliance.models.lora import LoraSpec, LoraWeights, load_adapter

# end-of-turn markers of the common templates: generation stops at them too, where the
# tokenizer holds one as a single token
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature 0), or drawn from the softmax at
    `temperature` over the smallest set of tokens whose probability reaches `top_p`, by a
    generator seeded with `seed` (on the CPU, so the draw is the same on any device)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a generation's blocks and caches live: `resident` blocks stay on the device, the
    others stream through two slots; `caches_on_device` or in host memory."""

    resident: frozenset[int]
    caches_on_device: bool


# families whose blocks carry more than a KV cache from token to token, or attend in a way
# the cached attention does not yet: they train, but `generate` does not decode them yet
_NOT_YET = {
    "Qwen3_5ForCausalLM": "its Gated DeltaNet layers need a recurrent state cache",
    "Qwen3_5MoeForCausalLM": "its Gated DeltaNet layers need a recurrent state cache",
    "Gemma4ForCausalLM": "its per-layer embeddings and shared K/V are not cached yet",
    "GptOssForCausalLM": "its attention sinks are not in the cached attention yet",
}


def family_problem(args: layers.ModelArgs) -> str | None:
    """Why `generate` cannot decode this model yet (None: it can)."""
    why = _NOT_YET.get(args.architecture)
    if why is None:
        return None
    return (
        f"generate: {args.architecture} is not supported yet ({why}); it trains and evaluates: "
        "export the adapter merged and decode it with transformers"
    )


class Generator:
    """A model (+ adapter) ready to generate; `close()` frees its device and host buffers.

    `copies` (CPU): stream blocks through slots as on CUDA (DeviceWeights' `copies`), for the
    tests' streamed runs on a machine without a GPU."""

    def __init__(
        self,
        model_dir: str | Path,
        adapter_dir: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        base_quant: str = "none",
        chat: ChatTemplate | None = None,
        gpu_memory_budget: int | None = None,
        copies: bool = False,
    ):
        self.args = hf_checkpoint.read_model_args(model_dir)  # refuses unsupported models
        if problem := family_problem(self.args):
            raise ConfigError(problem)
        hf_checkpoint.SafetensorsCheckpoint(model_dir).check(self.args)
        self.device, self.dtype, self.budget = torch.device(device), dtype, gpu_memory_budget
        self.tokenizer = load_tokenizer(hf_checkpoint.tokenizer_path(model_dir))
        self.chat = chat
        source = local_source(model_dir, str(dtype).removeprefix("torch."), base_quant)
        self.weights = DeviceWeights(source, self.device, dtype, copies=copies)
        if adapter_dir is not None:
            self.lora = load_adapter(adapter_dir, self.args, self.device)
        else:
            self.lora = LoraWeights(self.args, LoraSpec(targets=()))
        self.stop_ids = self._stop_ids()

    def close(self) -> None:
        self.weights.close()

    def _stop_ids(self) -> set[int]:
        ids = {self.args.eos_token_id} if self.args.eos_token_id is not None else set()
        for marker in END_OF_TURN:
            if (i := self.tokenizer.token_to_id(marker)) is not None:
                ids.add(i)
        return ids

    # ------------------------------------------------------------ prompts and text

    def encode(self, prompt: str) -> list[int]:
        """The prompt's tokens: one user turn rendered with the chat template and its
        generation prompt, or the raw text (with the tokenizer's BOS) without a template."""
        if self.chat is None:
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        text = self.chat.render([{"role": "user", "content": prompt}], True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def answer(self, prompts: Sequence[str], sampling: Sampling) -> list[str]:
        """Each prompt's answer, as text (the end token left out)."""
        outs = self.generate([self.encode(p) for p in prompts], sampling)
        return [self.decode([t for t in out if t not in self.stop_ids]) for out in outs]

    # ------------------------------------------------------------ placement

    def placement(self, batch: int, capacity: int) -> Placement:
        """What stays on the device for `batch` rows of up to `capacity` tokens (`place`): on a
        CPU every block and cache; on a GPU what the budget (--gpu-memory-budget, at most what
        the card has free) holds."""
        L = self.args.num_layers
        if self.device.type != "cuda":
            return Placement(frozenset(range(L)), True)
        a = self.args
        # activations: a few (B, T, C) and (B, T, intermediate) tensors, one step's attention
        # scores, and the fp32 logits of the batch's last tokens
        acts = batch * capacity * (4 * a.hidden_size + 3 * a.intermediate_size) * 4
        acts += batch * a.num_heads * capacity * capacity * 4 + batch * a.vocab_size * 8
        globals_ = sum(t.numel() * t.element_size() for t in self.weights.globals.values())
        free, total = torch.cuda.mem_get_info(self.device)
        budget = effective_budget(self.budget, total, free, torch.cuda.memory_reserved(self.device))
        return place(
            L,
            self.weights.block_bytes() + self.weights.dequant_bytes(),
            self._cache_bytes(batch, capacity),
            globals_ + acts,
            budget,
            f"{batch} prompt(s) of up to {capacity} tokens",
        )

    def _cache_bytes(self, batch: int, capacity: int) -> int:
        a = self.args
        return 2 * batch * a.num_kv_heads * capacity * a.head_dim * self.dtype.itemsize

    # ------------------------------------------------------------ decoding

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        placement: Placement | None = None,
        on_step: Callable[[list[int]], None] | None = None,
    ) -> list[list[int]]:
        """The tokens generated after each prompt (token ids), up to and including its end
        token, or `sampling.max_new_tokens` of them. `placement`: where blocks and caches live
        (default: `placement()`'s choice). `on_step`: told each step's new token of every row."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("every prompt needs at least one token")
        B, P = len(prompts), max(len(p) for p in prompts)
        capacity = P + sampling.max_new_tokens
        if capacity > self.args.max_position_embeddings:
            raise ConfigError(
                f"a prompt of {P} tokens and --max-new-tokens {sampling.max_new_tokens} pass the "
                f"model's {self.args.max_position_embeddings} positions: lower --max-new-tokens"
            )
        plan = placement or self.placement(B, capacity)
        self.weights.configure(set(plan.resident), slots=2)
        a, dev = self.args, self.device
        positions = Positions(torch.full((B, capacity), -1, dtype=torch.long, device=dev))
        store = dev if plan.caches_on_device else torch.device("cpu")
        shape = (B, a.num_kv_heads, capacity, a.head_dim)
        caches = [KVCache(positions, shape, self.dtype, dev, store) for _ in range(a.num_layers)]
        tables = {
            local: rope.rope_cos_sin(a, capacity, dev, self.dtype, local)
            for local in {a.local_rope(i) for i in range(a.num_layers)}
        }
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        ids = torch.zeros((B, P), dtype=torch.long, device=dev)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(list(p), device=dev)
        slots = torch.arange(P, device=dev).expand(B, P)
        keys = torch.where(slots < lengths[:, None], slots, -1)  # a short prompt's padding: -1
        # a padding slot's query stands at its row's last token, so it sees that token (in any
        # window) and stays finite: a row of no keys would give NaN, which the values of the
        # slots never seen would carry into every row (0 · NaN)
        queries = torch.minimum(slots, lengths[:, None] - 1)
        h = self._pass(ids, queries, 0, caches, positions, tables, keys)
        last = h[torch.arange(B, device=dev), lengths - 1]  # (B, C): each prompt's last token
        generator = torch.Generator().manual_seed(sampling.seed)
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(sampling.max_new_tokens):
            logits = layers.logits(last[:, None], self.weights.globals, a)[:, 0]  # (B, V) fp32
            tokens = choose(logits, sampling, generator)
            for r, t in enumerate(tokens):
                if not done[r]:
                    out[r].append(t)
                    done[r] = t in self.stop_ids
            if on_step is not None:
                on_step(tokens)
            if all(done) or step + 1 == sampling.max_new_tokens:
                break
            new = torch.tensor(tokens, device=dev)[:, None]  # (B, 1)
            h = self._pass(new, (lengths + step)[:, None], P + step, caches, positions, tables)
            last = h[:, -1]
        return out

    def _pass(self, ids, queries, first_slot, caches, positions, tables, keys=None):
        """One layer-major pass of the batch's new tokens `ids` (B, T) at `queries` (their
        positions, B × T), filling cache slots first_slot.. (`keys`: Positions.start_step): the
        last hidden states (B, T, C)."""
        a = self.args
        positions.start_step(queries, first_slot, keys)
        h = layers.embed(ids, self.weights.globals, a.embed_scale)
        tables_at = {local: rope.rope_at(*t, queries) for local, t in tables.items()}
        for i in range(a.num_layers):
            w = self.weights.get(i)
            self.weights.prefetch(i + 1)
            lora = self.lora.context(i, self.dtype, dropout=0.0)
            cos, sin = tables_at[a.local_rope(i)]
            h = block_forward(h, w, a, cos, sin, lora, caches[i], layer=i)
            self.weights.release(i)
            del w
        return h


def place(
    blocks: int, block_bytes: int, cache_bytes: int, other_bytes: int, budget: int, what: str
) -> Placement:
    """Where `blocks` blocks of `block_bytes` and their KV caches (`cache_bytes` each) go on a
    device of `budget` bytes of which `other_bytes` are taken (the globals, activations): all
    of it when it fits; else the caches if they fit beside two streaming slots, and as many
    blocks as the rest holds, resident from block 0 (the first a step needs). ConfigError naming
    --gpu-memory-budget when not even two slots fit (`what`: the batch, for the message)."""
    room = budget - other_bytes
    caches = blocks * cache_bytes
    if room >= blocks * block_bytes + caches:
        return Placement(frozenset(range(blocks)), True)
    on_device = room - 2 * block_bytes >= caches
    left = room - 2 * block_bytes - (caches if on_device else 0)
    if left < 0:
        need = (other_bytes + 2 * block_bytes + CUDA_MARGIN_BYTES) / 2**30
        raise ConfigError(
            f"--gpu-memory-budget: {budget / 2**30:.1f} GiB usable is too small to generate "
            f"{what}: at least {need:.1f} GiB needed; give fewer prompts at once, a smaller "
            "--max-new-tokens, or a larger budget"
        )
    return Placement(frozenset(range(min(blocks, left // block_bytes))), on_device)


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> list[int]:
    """Each row's next token: the argmax (temperature 0), or a draw from the softmax at the
    temperature over the top-p nucleus, made on the CPU with `generator`."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is under top_p (the first always stays)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= sampling.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
