"""The files of a full fine-tune (actors/full_trainer.py), written without holding them whole.

The model, in the Hugging Face layout: `config.json` (the base model's, its dtype the compute
dtype), the weights as `model.safetensors`, or `model-0000k-of-0000N.safetensors` shards with
`model.safetensors.index.json` past SHARD_BYTES (transformers' own names and index), and the base
model's tokenizer and generation files: a directory `AutoModelForCausalLM.from_pretrained` loads
as it is. Each weight file is a storage Stream (storage/checkpoints.py): its safetensors header,
then each tensor's bytes as a view of the host weights the engine trains (the store's home), so
writing a shard copies nothing into this process (only S3's multipart buffers, a part each).

The optimizer, in a checkpoint: `trainer_state.pt` (small: the step, the RNG, the part names)
and one `optimizer/<part>.pt` per part (a block, or the globals: engine/host_adam.py) holding
that part's fp32 masters and AdamW moments, serialised when it is written and dropped after, so
a checkpoint holds at most one part's state (12 B per parameter of one block) at a time.
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from appliance.storage.checkpoints import FileData

MODEL_DIR = "model"  # a checkpoint's copy of the model, in the Hugging Face layout
OPTIMIZER_DIR = "optimizer"  # a checkpoint's masters and moments, a file per part
HF_CONFIG = "config.json"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
INDEX = "model.safetensors.index.json"
# the base model's files that go beside the weights as they are
COPIED = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja")
# safetensors' names of the dtypes a model is trained in
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def written_files(names: list[str]) -> list[str]:
    """Of the file names at the top of an --output (relative, '/'-separated), those a full
    fine-tune writes there (FullTrainer.write_adapter), config.json first: what --overwrite
    removes."""
    top = [n for n in names if "/" not in n]
    ours = [
        n
        for n in top
        if n in ("model.safetensors", INDEX, *COPIED)
        or _SHARD.match(n)
        or n.startswith("tokenizer")
    ]
    return ([HF_CONFIG] if HF_CONFIG in top else []) + sorted(ours)


def shards(weights: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`weights` in order, cut into shards of at most `shard_bytes` (a bigger tensor alone)."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > shard_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


def safetensors_chunks(tensors: dict[str, torch.Tensor]) -> Iterator[bytes | memoryview]:
    """A safetensors file of `tensors` as chunks: the header, then each tensor's bytes as a view
    of the tensor itself (no copy of a contiguous tensor). The format: an 8-byte little-endian
    header length, a JSON header (dtype, shape, byte offsets of each tensor, padded with spaces
    to 8 bytes), the tensors back to back."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for t in tensors.values():
        if t.numel():
            yield memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def model_files(
    weights: dict[str, torch.Tensor], shard_bytes: int, base: Path, dtype: str
) -> dict[str, FileData]:
    """The model as file name → bytes or Stream (module doc): `weights` (checkpoint name →
    host tensor, read when its shard is written), the config and tokenizer files of `base`."""
    cut = shards(weights, shard_bytes)
    files: dict[str, FileData] = {}

    def stream(shard: dict[str, torch.Tensor]):
        return lambda: safetensors_chunks(shard)

    if len(cut) == 1:
        files["model.safetensors"] = stream(cut[0])
    else:
        weight_map = {}
        for k, shard in enumerate(cut, 1):
            fname = f"model-{k:05d}-of-{len(cut):05d}.safetensors"
            files[fname] = stream(shard)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files[INDEX] = json.dumps(index, indent=2).encode()
    config = json.loads((base / HF_CONFIG).read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    for f in sorted(base.iterdir()):
        if f.name in COPIED or f.name.startswith("tokenizer"):
            files[f.name] = f.read_bytes()
    files[HF_CONFIG] = json.dumps(config, indent=2).encode()
    return files


def part_file(part: str) -> str:
    """The checkpoint file of one part's masters and moments."""
    return f"{OPTIMIZER_DIR}/{part}.pt"


def torch_bytes(obj: object) -> memoryview:
    """torch.save of `obj`, as a view of its buffer (not copied again into bytes)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()
