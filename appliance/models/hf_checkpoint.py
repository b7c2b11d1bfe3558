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

from appliance import models
from appliance.errors import ModelError, appliance_command
from appliance.models import hf_config, multimodal, mxfp4
from appliance.models.layers import ModelArgs
from appliance.storage.checkpoints import json_object
from appliance.storage.names import why_outside

# the text architectures, then the multimodal ones whose language model is trained (see
# models/multimodal.py: the vision tower is left as it is)
SUPPORTED_ARCHITECTURES = models.SUPPORTED_ARCHITECTURES + multimodal.ARCHITECTURES
MOE_ARCHITECTURES = tuple(a for a, f in models.FAMILIES.items() if getattr(f, "MOE", False))
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
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
}
# what a safetensors file that cannot be read raises: a missing or unreadable file (OSError), a
# truncated or garbled header (SafetensorError), a tensor past the end of the file (RuntimeError)
_UNREADABLE = (OSError, RuntimeError, SafetensorError)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if what == "config.json" and (said := adapter_not_model(path.parent)):
            raise ModelError(said) from None
        raise ModelError(
            f"{path}: no {what} found; is this a Hugging Face model directory?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read {what}: {e}") from None


def adapter_not_model(directory: Path) -> str | None:
    """What a directory given as a base model is when it is a LoRA adapter (PEFT's
    adapter_config.json) or an appliance run's output (run.json), naming its base model; None
    for anything else."""
    more = ""
    try:
        run = json.loads((directory / "run.json").read_text())
        base = run["config"]["model"]
        what = "the output of an appliance run (run.json)"
        more = f"; to train it further: {appliance_command()} train --output {directory} --resume"
    except (OSError, ValueError, KeyError, TypeError):
        try:
            adapter = json.loads((directory / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return None
        base = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
        what = "a LoRA adapter (adapter_config.json)"
    named = f"its base model is {base}" if base else "it does not name its base model"
    return (
        f"{directory} is {what}, not a base model: {named}. Give the base model as --model, "
        f"and this directory as --adapter ({appliance_command()} eval, export){more}"
    )


def _refusal(arch: str, cfg: dict) -> str | None:
    """Why a known kind of model cannot run here (None: no specific reason)."""
    experts = ("num_experts", "num_local_experts", "n_routed_experts")
    text = cfg.get("text_config") or {}
    moe = any(cfg.get(k) or text.get(k) for k in experts) or "Moe" in arch or "Mixtral" in arch
    if moe and arch not in SUPPORTED_ARCHITECTURES:  # (checked before the vision tower)
        return (
            "is a mixture-of-experts model whose routing is not implemented; supported "
            f"mixture-of-experts models: {', '.join(MOE_ARCHITECTURES)}"
        )
    if arch in multimodal.ARCHITECTURES:
        return None
    if "vision_config" in cfg or arch.endswith("ForConditionalGeneration"):
        return (
            "has a vision tower; supported are text-only causal LMs and the language model of "
            f"{' and '.join(multimodal.ARCHITECTURES)}"
        )
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
        fields = hf_config.model_fields(arch, cfg, where)
        fields["language_model_of"] = language_model_of
        if fields["eos_token_id"] is None:
            fields["eos_token_id"] = _eos_elsewhere(model_dir)
        if fields["tie_word_embeddings"] and language_model_of is None and _own_head(model_dir):
            fields["tie_word_embeddings"] = False  # the files' head, as transformers takes it
        if arch == "Qwen3_5MoeForCausalLM":
            fields["fused_experts"] = _fused_experts(model_dir)
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


def _fused_experts(model_dir: Path) -> bool:
    """Whether a Qwen3.5-MoE checkpoint stores its experts fused (`mlp.experts.gate_up_proj`, as
    released) rather than one matrix each (as transformers' save_pretrained writes them); fused
    with no weights here (`appliance plan` on a config.json alone): the released layout."""
    try:
        files = SafetensorsCheckpoint(model_dir).files
    except ModelError:
        return True
    return "model.layers.0.mlp.experts.0.gate_proj.weight" not in files


def _eos_elsewhere(model_dir: Path) -> int | None:
    """The end-of-sequence id of a model whose config.json names none: generation_config.json's
    `eos_token_id` (the first of a list), else the id tokenizer.json gives tokenizer_config.json's
    `eos_token`, as transformers' generate and tokenizer find them."""
    from tokenizers import Tokenizer

    eos = (json_object(model_dir / "generation_config.json") or {}).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int):
        return eos
    token = (json_object(model_dir / "tokenizer_config.json") or {}).get("eos_token")
    if isinstance(token, dict):  # {"content": "</s>", ...}, as older tokenizers write it
        token = token.get("content")
    if not isinstance(token, str) or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(token)
    except Exception:  # noqa: BLE001 - a tokenizer that does not load names no id (and is
        return None  # refused by name where the tokenizer is loaded)


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
            for f in set(weight_map.values()):  # shards are in the model's directory
                if (why := why_outside(str(f))) is not None:
                    raise ModelError(
                        f"{index}: names the shard {f!r}, outside {self.dir} ({why}); "
                        "download the model again"
                    )
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
        # MXFP4 tensors (gpt-oss's released experts, models/mxfp4.py): presented under their own
        # name, dequantized when read; name → (its blocks' name, its scales' name)
        self.packed = mxfp4.packed_pairs(self.files)
        self._packed_files: dict[str, tuple[Path, Path]] = {}  # name → its parts' files
        # read "as stored" (dtype None: the export), they take the dtype config.json gives
        self.packed_dtype = _config_dtype(self.dir) if self.packed else torch.bfloat16
        for name, (blocks, scales) in self.packed.items():
            self._packed_files[name] = (self.files.pop(blocks), self.files.pop(scales))
            self.files[name] = self._packed_files[name][0]

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
                    if n in self.packed:  # MXFP4: dequantized (bf16 "as stored")
                        out[n] = self._dequantized(n, dtype or self.packed_dtype)
                        continue
                    t = f.get_tensor(self.stored_name(n))
                    out[n] = t if dtype is None else t.to(dtype)
        return out

    def _dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """An MXFP4 tensor (`name`_blocks and `name`_scales) in `dtype`."""
        parts = []
        for stored, path in zip(self.packed[name], self._packed_files[name], strict=True):
            with _opened(path) as f:
                parts.append(f.get_tensor(self.stored_name(stored)))
        blocks, scales = parts
        try:
            mxfp4.dequantized_shape(tuple(blocks.shape), tuple(scales.shape), name)
        except ValueError as e:
            raise ModelError(f"{self.dir}: {e}") from None
        return mxfp4.dequantize(blocks, scales, dtype)

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
        for name, (blocks, scales) in self.packed.items():  # MXFP4: the dequantized tensor
            shape = self.packed_shape(name, out.pop(blocks), out.pop(scales))
            out[name] = (shape, _ST_NAMES.get(self.packed_dtype, "BF16"))
        return out

    def packed_shape(self, name: str, blocks: tuple, scales: tuple) -> tuple[int, ...]:
        """The dequantized shape of an MXFP4 tensor from its parts' (shape, dtype); a
        ModelError naming it when they are not the released layout."""
        if blocks[1] != "U8" or scales[1] != "U8":
            raise ModelError(
                f"{self.dir}: {name}: MXFP4 blocks and scales must be uint8, not "
                f"{blocks[1]} and {scales[1]}"
            )
        try:
            return mxfp4.dequantized_shape(blocks[0], scales[0], name)
        except ValueError as e:
            raise ModelError(f"{self.dir}: {e}") from None


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie in a safetensors file (from its header), to read them in place."""

    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # safetensors name: 'BF16', 'F32', ...; 'MXFP4': the blocks (below)
    # MXFP4 (models/mxfp4.py): this location is the codes' (`_blocks`), this the scales', and
    # `shape` the dequantized tensor's
    scales: TensorLocation | None = None


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


_ST_NAMES = {t: name for name, t in ST_DTYPES.items()}


def _config_dtype(model_dir: Path) -> torch.dtype:
    """The floating dtype config.json names (`dtype`, or `torch_dtype` as older transformers
    wrote it), bfloat16 where it names none."""
    cfg = json_object(model_dir / "config.json") or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


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
    for name, (blocks, scales) in ckpt.packed.items():  # MXFP4: one location of both parts
        b, s = out.pop(blocks), out.pop(scales)
        shape = ckpt.packed_shape(name, (b.shape, b.dtype), (s.shape, s.dtype))
        out[name] = TensorLocation(b.path, b.offset, b.nbytes, shape, "MXFP4", s)
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
    out.update(models.global_shapes(args))
    for i in range(args.num_layers):
        out.update(block_shapes(args, i))
    return out


def block_shapes(args: ModelArgs, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensor names (full) with the shapes config.json implies."""
    return {f"model.layers.{i}.{k}": shape for k, shape in models.block_shapes(args, i).items()}


def seq_len_problems(args: ModelArgs, seq_len: int) -> list[str]:
    """Why `--seq-len` cannot be used with this model (empty when it can)."""
    problems = []
    if seq_len > args.max_position_embeddings:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings}): give --seq-len {args.max_position_embeddings} "
            "or less"
        )
    # sliding windows are implemented by every family but Llama's (layers.attention: Mistral)
    llama = models.FAMILIES[args.architecture] is models.llama
    if llama and args.sliding_window and seq_len > args.sliding_window:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's sliding_window ({args.sliding_window}); "
            f"sliding-window attention is not implemented for {args.architecture}: give "
            f"--seq-len {args.sliding_window} or less"
        )
    return problems


# tensors a checkpoint may hold beside the text model, by what they are (prefix → name)
_SKIPPED_KINDS = (
    ("mtp.", "multi-token-prediction"),
    ("model.mtp.", "multi-token-prediction"),
    ("model.visual.", "vision tower"),
    ("visual.", "vision tower"),
    ("vision_tower.", "vision tower"),
    ("model.vision_tower.", "vision tower"),
    ("multi_modal_projector.", "multimodal projector"),
    ("model.audio_tower.", "audio tower"),
    ("model.embed_vision.", "multimodal projector"),
    ("model.embed_audio.", "multimodal projector"),
    ("model.multi_modal_projector.", "multimodal projector"),
)


def skipped_notes(ckpt: SafetensorsCheckpoint, args: ModelArgs) -> list[str]:
    """One line per kind of tensor in the checkpoint that the text model does not read (Qwen3.5's
    multi-token-prediction head, a vision tower, ...): what the run leaves out, named; the
    export copies the files' other tensors as they are."""
    wanted = set(expected_shapes(args))
    by_kind: dict[str, list[str]] = {}
    for name in ckpt.files:
        if name in wanted:
            continue
        stored = ckpt.stored_name(name)
        kind = next((k for p, k in _SKIPPED_KINDS if stored.startswith(p)), "other")
        by_kind.setdefault(kind, []).append(stored)
    return [
        f"{ckpt.dir}: {len(names)} {kind} tensor{'s' if len(names) > 1 else ''} not read "
        f"(the text model is trained alone), e.g. {sorted(names)[0]}"
        for kind, names in sorted(by_kind.items())
    ]


def block_names(args: ModelArgs, i: int) -> list[str]:
    """The HF tensor names of block i (full names, with the `model.layers.{i}.` prefix)."""
    return list(block_shapes(args, i))


def global_names(args: ModelArgs) -> list[str]:
    """The tensors outside the blocks: embeddings, final norm, and the LM head unless tied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    return names + list(models.global_shapes(args))  # Gemma 4's per-layer embeddings


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
