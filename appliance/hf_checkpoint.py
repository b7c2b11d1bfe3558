"""Reading Hugging Face model directories: config.json, safetensors shards, tokenizer.json.

The architecture is checked from `config.json` before any weight is read. Weights are read one
block at a time through `safe_open`, so host memory stays near one copy of the model in the
compute dtype however the checkpoint is stored.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import ModelError
from .model import TARGET_MODULES, ModelArgs

_LINEARS = frozenset(TARGET_MODULES.values())

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# what a safetensors file that cannot be read raises: a missing or unreadable file (OSError), a
# truncated or garbled header (SafetensorError), a tensor past the end of the file (RuntimeError)
_UNREADABLE = (OSError, RuntimeError, SafetensorError)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(
            f"{path}: no {what} found; is this a Hugging Face model directory?"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read {what}: {e}") from None


def read_model_args(model_dir: str | Path) -> ModelArgs:
    """Parse and check `config.json`; refuse anything the engine does not implement, by name."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"model directory {model_dir} does not exist (pass --model DIR)")
    cfg = _read_json(model_dir / "config.json", "config.json")
    where = model_dir / "config.json"
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
    # transformers ≥5 nests rope settings in `rope_parameters`; older files use rope_theta/rope_scaling
    rope_field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = dict(cfg.get(rope_field) or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise ModelError(f"{where}: {rope_field} of type llama3 lacks {', '.join(missing)}")
        rope_scaling = tuple(sorted((k, float(rope[k])) for k in keys))
    elif rope_type != "default":
        raise ModelError(
            f"{where}: {rope_field} type {rope_type!r} is not supported (only llama3 or none)"
        )
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelError(
            f"{where}: partial_rotary_factor={partial} is not supported (only 1.0: RoPE on every "
            "dimension of a head)"
        )

    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        attention_bias, o_bias = True, False  # Qwen2: bias on q, k, v only
        if cfg.get("use_sliding_window", False):
            raise ModelError(f"{where}: use_sliding_window=true is not supported")
        sliding = None
    else:
        o_bias = attention_bias
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    try:
        return ModelArgs(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=cfg.get("pad_token_id"),
        )
    except KeyError as e:
        raise ModelError(f"{where}: missing required field {e.args[0]!r}") from None


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
    """Name → file index over one `model.safetensors` or sharded files with an index JSON."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            weight_map = _read_json(index, "safetensors index")["weight_map"]
            self.files = {name: self.dir / f for name, f in weight_map.items()}
        elif single.is_file():
            with _opened(single) as f:
                self.files = {name: single for name in f.keys()}
        elif any(self.dir.glob("pytorch_model*.bin")):
            raise ModelError(pytorch_bin_message(self.dir))
        else:
            raise ModelError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json; "
                "save the model with safe_serialization=True"
            )
        for path in set(self.files.values()):
            if not path.is_file():
                raise ModelError(f"{path}: shard named in the index is missing")

    def read(self, names: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Read `names` (grouped by shard) converted to `dtype` (None: as stored)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.files:
                raise ModelError(f"{self.dir}: tensor {n!r} is missing from the checkpoint")
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for path, group in by_file.items():
            with _opened(path) as f:
                for n in group:
                    t = f.get_tensor(n)
                    out[n] = t if dtype is None else t.to(dtype)
        return out

    def check(self, args: ModelArgs) -> None:
        """Before any weight is read: every tensor the model needs is in a readable file, with
        the shape config.json implies. Reads the files' headers only (cheap, however large)."""
        shapes = {name: shape for name, (shape, _) in self.headers().items()}
        for name, shape in expected_shapes(args).items():
            if name not in shapes:
                raise ModelError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
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
                for name in f.keys():
                    s = f.get_slice(name)
                    out[name] = (tuple(s.get_shape()), s.get_dtype())
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
    out = {}
    for name in block_names(args, i):
        module, kind = name.removeprefix(f"model.layers.{i}.").rsplit(".", 1)
        if module in _LINEARS:
            rows, cols = args.module_shape(module)
            out[name] = (rows, cols) if kind == "weight" else (rows,)
        else:  # the two RMSNorm weights
            out[name] = (args.hidden_size,)
    return out


def seq_len_problems(args: ModelArgs, seq_len: int) -> list[str]:
    """Why `--seq-len` cannot be used with this model (empty when it can)."""
    problems = []
    if seq_len > args.max_position_embeddings:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings})"
        )
    if args.sliding_window and seq_len > args.sliding_window:
        problems.append(
            f"--seq-len {seq_len} exceeds the model's sliding_window ({args.sliding_window}); "
            "sliding-window attention is not implemented"
        )
    return problems


def block_names(args: ModelArgs, i: int) -> list[str]:
    """The HF tensor names of block i (full names, with the `model.layers.{i}.` prefix)."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names.append(f"{p}self_attn.{m}.weight")
        if (args.attention_bias and m != "o_proj") or (args.o_bias and m == "o_proj"):
            names.append(f"{p}self_attn.{m}.bias")
    for m in ("gate_proj", "up_proj", "down_proj"):
        names.append(f"{p}mlp.{m}.weight")
        if args.mlp_bias:
            names.append(f"{p}mlp.{m}.bias")
    return names


def read_globals(
    ckpt: SafetensorsCheckpoint, args: ModelArgs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    return ckpt.read(names, dtype)


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
