"""Reading Hugging Face model directories: config.json, safetensors shards, tokenizer.json.

The architecture is checked from `config.json` before any weight is read. Weights are read one
block at a time through `safe_open`, so host memory stays near one copy of the model in the
compute dtype however the checkpoint is stored.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from . import models
from .errors import ModelError
from .model import ModelArgs
from .models import multimodal

# the text architectures, then the multimodal ones whose language model is trained (see
# models/multimodal.py: the vision tower is left as it is)
SUPPORTED_ARCHITECTURES = models.SUPPORTED_ARCHITECTURES + multimodal.ARCHITECTURES
# the architecture of a config.json that names none, by its model_type (transformers'
# AutoModelForCausalLM mapping, for the families supported here)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
}
# what a safetensors file that cannot be read raises: a missing or unreadable file (OSError), a
# truncated or garbled header (SafetensorError), a tensor past the end of the file (RuntimeError)
_UNREADABLE = (OSError, RuntimeError, SafetensorError)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(
            f"{path}: no {what} found; is this a Hugging Face model directory?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read {what}: {e}") from None


def _refusal(arch: str, cfg: dict) -> str | None:
    """Why a known kind of model cannot run here (None: no specific reason)."""
    if arch in multimodal.ARCHITECTURES:
        return None
    if "vision_config" in cfg or arch.endswith("ForConditionalGeneration"):
        return (
            "has a vision tower; supported are text-only causal LMs and the language model of "
            f"{' and '.join(multimodal.ARCHITECTURES)}"
        )
    experts = ("num_experts", "num_local_experts", "n_routed_experts")
    if any(cfg.get(k) for k in experts) or "Moe" in arch or "Mixtral" in arch:
        return "is a mixture-of-experts model; mixture-of-experts models are not supported yet"
    return None


def read_model_args(model_dir: str | Path) -> ModelArgs:
    """Parse and check `config.json`; refuse anything the engine does not implement, by name."""
    model_dir = Path(model_dir)
    if model_dir.is_file():  # model.safetensors or config.json given for the directory
        raise ModelError(
            f"--model {model_dir} is a file: pass the directory that holds config.json and the "
            f"weights (--model {model_dir.parent}?)"
        )
    if not model_dir.is_dir():
        raise ModelError(f"model directory {model_dir} does not exist (pass --model DIR)")
    cfg = _read_json(model_dir / "config.json", "config.json")
    where = model_dir / "config.json"
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MODEL_TYPES:  # as AutoModelForCausalLM reads it
        archs = [MODEL_TYPES[cfg["model_type"]]]
    name = archs or cfg.get("model_type")
    why = _refusal(archs[0] if len(archs) == 1 else "", cfg)
    if why:
        raise ModelError(f"{where}: architecture {name!r} {why}")
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{where}: architecture {name!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = language_model_of = archs[0]
    if arch in multimodal.ARCHITECTURES:  # train its language model: the text model's config
        arch, cfg = multimodal.language_config(cfg)
        where = Path(f"{where} (text_config)")
        has_lm_head = _has_lm_head(model_dir)
        if has_lm_head is not None:  # as transformers ties them: by what the files hold
            cfg["tie_word_embeddings"] = not has_lm_head
    else:
        language_model_of = None
    try:
        fields = _common_fields(arch, cfg, where)
        fields["language_model_of"] = language_model_of
        family = models.FAMILIES[arch]
        if family is models.qwen3:
            fields.update(_qwen3_fields(cfg, where))
        elif family is models.gemma:
            fields.update(_gemma_fields(arch, cfg, where, fields["num_layers"]))
        elif family is models.phi3:
            fields.update(_phi3_fields(cfg, where, fields))
        else:
            fields.update(_llama_fields(arch, cfg, where))
        if fields["eos_token_id"] is None:
            fields["eos_token_id"] = _eos_elsewhere(model_dir)
        if fields["tie_word_embeddings"] and language_model_of is None and _own_head(model_dir):
            fields["tie_word_embeddings"] = False  # the files' head, as transformers takes it
        return ModelArgs(**fields)
    except KeyError as e:
        raise ModelError(f"{where}: missing required field {e.args[0]!r}") from None


def _has_lm_head(model_dir: Path) -> bool | None:
    """Whether a multimodal checkpoint stores an LM head of its own (None: no weights here, as
    for `appliance plan` on a config.json alone). transformers ties a multimodal model's LM head
    to its embeddings only when the files hold no other: the released Gemma 3 files hold none,
    Mistral Small 3.1's do, and their configs do not say so alike."""
    try:
        return "lm_head.weight" in SafetensorsCheckpoint(model_dir).files
    except ModelError:
        return None


def _eos_elsewhere(model_dir: Path) -> int | None:
    """The end-of-sequence id of a model whose config.json names none: generation_config.json's
    `eos_token_id` (the first of a list), else the id of tokenizer_config.json's `eos_token` in
    tokenizer.json, as transformers' generate and tokenizer find them."""
    generation = model_dir / "generation_config.json"
    eos = _json_or_empty(generation).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int):
        return eos
    token = _json_or_empty(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # {"content": "</s>", ...}, as older tokenizers write it
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tokenizer = _json_or_empty(model_dir / "tokenizer.json")
    added = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens") or []}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    found = added.get(token, vocab.get(token) if isinstance(vocab, dict) else None)
    return found if isinstance(found, int) else None


def _json_or_empty(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing or not one (the file is optional here)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _own_head(model_dir: Path) -> bool:
    """Whether a text model whose config.json ties its LM head to its embeddings holds a head of
    its own in its files, other than the embeddings (a fine-tune that trained or resized its
    head and kept the config): transformers then does not tie them and computes with the files'
    head (it warns), and so does the export's merged model; training and eval must too. False
    with no weights here (`appliance plan` on a config.json alone)."""
    try:
        ckpt = SafetensorsCheckpoint(model_dir)
        if "lm_head.weight" not in ckpt.files:
            return False
        t = ckpt.read(["lm_head.weight", "model.embed_tokens.weight"], None)
    except (ModelError, KeyError):
        return False
    head, embeddings = t["lm_head.weight"], t["model.embed_tokens.weight"]
    return head.shape != embeddings.shape or not torch.equal(head, embeddings)


def _common_fields(arch: str, cfg: dict, where: Path) -> dict[str, Any]:
    """What every family reads the same way (the family readers below override some)."""
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return dict(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=cfg.get("pad_token_id"),
    )


def _rope_dict(cfg: dict) -> tuple[str, dict]:
    """(the field's name, its contents): transformers ≥5 nests rope settings in
    `rope_parameters`; older files use rope_theta / rope_scaling."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    return field, dict(cfg.get(field) or {})


def _rope(
    rope: dict, cfg: dict, where: Path, field: str, kinds: tuple[str, ...], theta: float = 1e4
) -> tuple[float, tuple | None]:
    """(rope_theta, ModelArgs.rope_scaling) from one rope settings dict, of a type in `kinds`."""
    rope = dict(rope)
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", theta)))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind == "su":  # Phi-3's early name for longrope
        kind = "longrope"
    if kind == "default":
        return rope_theta, None
    if kind not in kinds:
        raise ModelError(
            f"{where}: {field} type {kind!r} is not supported (only "
            f"{' or '.join(kinds + ('none',))})"
        )
    keys = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "linear": ("factor",),
        "longrope": ("short_factor", "long_factor"),
    }[kind]
    if kind != "linear" and "original_max_position_embeddings" in cfg:
        rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    if kind != "linear":
        keys += ("original_max_position_embeddings",)
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ModelError(f"{where}: {field} of type {kind} lacks {', '.join(missing)}")
    lists = ("short_factor", "long_factor")
    items: dict[str, Any] = {k: float(rope[k]) for k in keys if k not in lists}
    if kind == "llama3":  # (no rope_type item: llama3 is the default reading of rope_scaling)
        return rope_theta, tuple(sorted(items.items()))
    items["rope_type"] = kind
    if kind == "longrope":
        items["short_factor"] = tuple(float(x) for x in rope["short_factor"])
        items["long_factor"] = tuple(float(x) for x in rope["long_factor"])
        for k in ("factor", "attention_factor"):  # optional (model.rope_attention_factor)
            if rope.get(k) is not None:
                items[k] = float(rope[k])
    return rope_theta, tuple(sorted(items.items()))


def _activation(cfg: dict, where: Path, key: str, allowed: str) -> str:
    act = cfg.get(key, allowed)
    if act != allowed:
        raise ModelError(f"{where}: {key}={act!r} is not supported (only {allowed!r})")
    return act


def _no_partial_rotary(cfg: dict, rope: dict, where: Path) -> None:
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} is not supported (only 1.0: RoPE on every "
            "dimension of a head)"
        )


def _llama_fields(arch: str, cfg: dict, where: Path) -> dict[str, Any]:
    """Llama, Mistral, Qwen2."""
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ("llama3",))
    _no_partial_rotary(cfg, rope, where)
    out: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    out["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        out["attention_bias"], out["o_bias"] = True, False  # Qwen2: bias on q, k, v only
        if cfg.get("use_sliding_window", False):
            raise ModelError(f"{where}: use_sliding_window=true is not supported")
        sliding = None
    out["sliding_window"] = int(sliding) if sliding else None
    return out


def _qwen3_fields(cfg: dict, where: Path) -> dict[str, Any]:
    _activation(cfg, where, "hidden_act", "silu")
    if cfg.get("use_sliding_window", False):
        raise ModelError(f"{where}: use_sliding_window=true is not supported")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ())
    _no_partial_rotary(cfg, rope, where)
    return dict(rope_theta=theta, rope_scaling=scaling, qk_norm=True)


def _layer_types(cfg: dict, where: Path, num_layers: int, pattern: int) -> tuple[str, ...]:
    """`layer_types` as written, else the alternation: every `pattern`-th block full, the
    others sliding (Gemma 2: 2, Gemma 3: sliding_window_pattern, 6 by default)."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    bad = [t for t in types if t not in _LAYER_TYPES]
    if len(types) != num_layers or bad:
        raise ModelError(
            f"{where}: layer_types must list {num_layers} of {', '.join(_LAYER_TYPES)} "
            f"(found {len(types)}{', e.g. ' + repr(bad[0]) if bad else ''})"
        )
    return tuple(types)


def _gemma_fields(arch: str, cfg: dict, where: Path, num_layers: int) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text)."""
    key = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"  # the first wins
    _activation(cfg, where, key, "gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(f"{where}: use_bidirectional_attention=true is not supported")
    hidden = int(cfg["hidden_size"])
    gemma3 = arch == "Gemma3ForCausalLM"
    out: dict[str, Any] = dict(
        norm_offset=1.0,
        embed_scale=hidden**0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        # transformers' Gemma 3 attention does not apply attn_logit_softcapping: neither do we
        attn_softcap=None if gemma3 else _float_or_none(cfg.get("attn_logit_softcapping")),
        final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        qk_norm=gemma3,
    )
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    out["layer_types"] = _layer_types(cfg, where, num_layers, pattern if gemma3 else 2)
    field, rope = _rope_dict(cfg)
    if not gemma3:
        out["rope_theta"], out["rope_scaling"] = _rope(rope, cfg, where, field, ())
        _no_partial_rotary(cfg, rope, where)
        return out
    if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (transformers ≥5)
        full, local = (
            dict(rope.get("full_attention") or {}),
            dict(rope.get("sliding_attention") or {}),
        )
    else:  # rope_theta + rope_scaling for the full layers, rope_local_base_freq for the others
        full = {**rope, "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    out["rope_theta"], out["rope_scaling"] = _rope(
        full, {}, where, f"{field} (full_attention)", ("linear",), theta=1e6
    )
    out["rope_local_theta"], _ = _rope(
        local, {}, where, f"{field} (sliding_attention)", (), theta=1e4
    )
    return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _phi3_fields(cfg: dict, where: Path, common: dict[str, Any]) -> dict[str, Any]:
    _activation(cfg, where, "hidden_act", "silu")
    field, rope = _rope_dict(cfg)
    theta, scaling = _rope(rope, cfg, where, field, ("longrope",))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rot = int(common["head_dim"] * partial)
    if not 0 < partial <= 1 or rot < 2 or rot % 2:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} gives {rot} rotated dimensions per head; "
            "need an even number ≥ 2"
        )
    for key, value in scaling or ():
        if key in ("short_factor", "long_factor") and len(value) != rot // 2:
            raise ModelError(
                f"{where}: {field}.{key} has {len(value)} values; {rot // 2} expected "
                f"(half the {rot} rotated dimensions)"
            )
    sliding = cfg.get("sliding_window")
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        attention_bias=False,  # Phi-3's projections have no bias
        o_bias=False,
        sliding_window=int(sliding) if sliding else None,
    )


def tokenizer_path(model_dir: str | Path) -> Path:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ModelError(
            f"{path}: no tokenizer.json in the model directory; save the model's fast tokenizer "
            "there (tokenizer.save_pretrained(DIR))"
        )
    return path


def pytorch_bin_message(model_dir: Path) -> str:
    """What to run when a model has only pytorch_model*.bin: the one command that writes a
    safetensors copy beside it (with transformers installed), and the --model to pass then."""
    out = f"{model_dir}-safetensors"
    code = (  # the tokenizer and other files copied as they are, the weights re-saved
        "import shutil; from transformers import AutoModelForCausalLM as M; "
        f"shutil.copytree('{model_dir}', '{out}', dirs_exist_ok=True, "
        "ignore=shutil.ignore_patterns('pytorch_model*')); "
        f"M.from_pretrained('{model_dir}', torch_dtype='auto')"
        f".save_pretrained('{out}', safe_serialization=True)"
    )
    return (
        f"{model_dir}: only pytorch_model*.bin (pickle) weights, and the appliance reads "
        f'safetensors; convert them with: python -c "{code}" and pass --model {out}'
    )


class SafetensorsCheckpoint:
    """Name → file index over one `model.safetensors` or sharded files with an index JSON.

    Names are the text model's (`model.layers.0.…`, `lm_head.weight`): a multimodal checkpoint's
    language-model tensors are presented under them (models/multimodal.py), its other tensors
    (vision tower, projector) under their own names; `stored_name` gives a name in the files."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            weight_map = _read_json(index, "safetensors index")["weight_map"]
            files = {name: self.dir / f for name, f in weight_map.items()}
        elif single.is_file():
            with _opened(single) as f:
                files = {name: single for name in f.keys()}
        elif any(self.dir.glob("pytorch_model*.bin")):
            raise ModelError(pytorch_bin_message(self.dir))
        elif shards := sorted(f.name for f in self.dir.glob("model-*-of-*.safetensors")):
            raise ModelError(
                f"{self.dir}: {len(shards)} safetensors shards ({shards[0]}, ...) but no "
                "model.safetensors.index.json, which says which tensor is in which shard: "
                "download it again with the shards"
            )
        else:
            raise ModelError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json; "
                "save the model with safe_serialization=True"
            )
        for path in set(files.values()):
            if not path.is_file():
                raise ModelError(f"{path}: shard named in the index is missing")
        # name → name in the files, where they differ (a multimodal checkpoint's language model)
        self._stored = multimodal.language_names(files)
        self._name = {stored: name for name, stored in self._stored.items()}
        self.files = {self._name.get(stored, stored): path for stored, path in files.items()}

    def stored_name(self, name: str) -> str:
        """The name a tensor has in the files."""
        return self._stored.get(name, name)

    def name_of(self, stored: str) -> str:
        """The name a tensor of the files has here."""
        return self._name.get(stored, stored)

    def _missing(self, name: str) -> ModelError:
        stored = multimodal.stored_name_like(name, self._stored)
        return ModelError(f"{self.dir}: tensor {stored!r} is missing from the checkpoint")

    def read(self, names: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Read `names` (grouped by shard) converted to `dtype` (None: as stored)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.files:
                raise self._missing(n)
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for path, group in by_file.items():
            with _opened(path) as f:
                for n in group:
                    t = f.get_tensor(self.stored_name(n))
                    out[n] = t if dtype is None else t.to(dtype)
        return out

    def check(self, args: ModelArgs) -> None:
        """Before any weight is read: every tensor the model needs is in a readable file, with
        the shape config.json implies. Reads the files' headers only (cheap, however large)."""
        shapes = {name: shape for name, (shape, _) in self.headers().items()}
        for name, shape in expected_shapes(args).items():
            if name not in shapes:
                raise self._missing(name)
            if shapes[name] != shape:
                raise ModelError(
                    f"{self.dir}: {name} has shape {shapes[name]}, config.json implies {shape}"
                )

    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name → (shape, safetensors dtype such as 'BF16') of every tensor in the files, from
        their headers only (no tensor is read)."""
        out = {}
        for path in sorted(set(self.files.values())):
            with _opened(path) as f:
                for stored in f.keys():
                    s = f.get_slice(stored)
                    out[self.name_of(stored)] = (tuple(s.get_shape()), s.get_dtype())
        return out


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie in a safetensors file (from its header), to read them in place."""

    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # safetensors name: 'BF16', 'F32', ...


# safetensors dtype names → torch (the ones a weight can have; others are refused by name)
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def tensor_locations(ckpt: SafetensorsCheckpoint) -> dict[str, TensorLocation]:
    """name (as `ckpt.files` names it) → TensorLocation of every tensor in the checkpoint's
    files, from the headers.

    The safetensors layout: an 8-byte little-endian header length N, N bytes of JSON
    {name: {dtype, shape, data_offsets: [begin, end]}} (offsets relative to byte 8 + N), then
    the data. Reading the headers ourselves lets the WeightStore read each tensor's bytes
    straight into its block buffer (no intermediate tensor)."""
    out = {}
    for path in sorted(set(ckpt.files.values())):
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
        except (OSError, ValueError) as e:
            raise ModelError(
                f"{path}: cannot read safetensors header: {e}; re-download or re-save the model"
            ) from None
        for stored, meta in header.items():
            if stored == "__metadata__":
                continue
            name = ckpt.name_of(stored)
            begin, end = meta["data_offsets"]
            if 8 + n + end > size:
                raise ModelError(
                    f"{path}: tensor {stored} lies past the end of the file (truncated?); "
                    "re-download or re-save the model"
                )
            out[name] = TensorLocation(
                path, 8 + n + begin, end - begin, tuple(meta["shape"]), meta["dtype"]
            )
    return out


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """`safe_open(path)`; any failure to read it, header or tensors, is a ModelError naming it."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except _UNREADABLE as e:
        raise ModelError(
            f"{path}: cannot read safetensors file: {e}; re-download or re-save the model"
        ) from None


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model reads, with the shape config.json implies."""
    C, V = args.hidden_size, args.vocab_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, C),
        "model.norm.weight": (C,),
    }
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    for i in range(args.num_layers):
        out.update(block_shapes(args, i))
    return out


def block_shapes(args: ModelArgs, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensor names (full) with the shapes config.json implies."""
    return {f"model.layers.{i}.{k}": shape for k, shape in models.block_shapes(args).items()}


def seq_len_problems(args: ModelArgs, seq_len: int) -> list[str]:
    """Why `--seq-len` cannot be used with this model (empty when it can)."""
    problems = []
    if seq_len > args.max_position_embeddings:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings}): give --seq-len {args.max_position_embeddings} "
            "or less"
        )
    # sliding windows are implemented by every family but Llama's (model.attention: Mistral)
    llama = models.FAMILIES[args.architecture] is models.llama
    if llama and args.sliding_window and seq_len > args.sliding_window:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's sliding_window ({args.sliding_window}); "
            f"sliding-window attention is not implemented for {args.architecture}: give "
            f"--seq-len {args.sliding_window} or less"
        )
    return problems


def block_names(args: ModelArgs, i: int) -> list[str]:
    """The HF tensor names of block i (full names, with the `model.layers.{i}.` prefix)."""
    return list(block_shapes(args, i))


def global_names(args: ModelArgs) -> list[str]:
    """The tensors outside the blocks: embeddings, final norm, and the LM head unless tied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def read_globals(
    ckpt: SafetensorsCheckpoint, args: ModelArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    return ckpt.read(global_names(args), dtype)


def read_block(
    ckpt: SafetensorsCheckpoint, args: ModelArgs, i: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Block i's tensors keyed without the layer prefix, shapes checked against config.json."""
    shapes = block_shapes(args, i)
    tensors = ckpt.read(list(shapes), dtype)
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise ModelError(
                f"{ckpt.dir}: {name} has shape {tuple(t.shape)}, config.json implies {shapes[name]}"
            )
    prefix = f"model.layers.{i}."
    return {name[len(prefix) :]: t for name, t in tensors.items()}
