"""`appliance export`: base model + LoRA adapter merged into a plain Hugging Face checkpoint.

For every adapted linear layer W' = W + (B @ A) · alpha / rank, computed in fp32 and stored in
W's own dtype; every other tensor is copied unchanged, under the name it has in the base model's
files, and so is every other file of the model directory (tokenizer, chat template, generation
and processor configs, licence), weights excepted, and its README.md: the base model's card is
replaced by the merged model's (model_card.py), which names the base model and carries its
licence. The result loads with
`AutoModelForCausalLM.from_pretrained` (no peft needed), an image-text model with its own class
and its vision tower as it was (models/multimodal.py), and gives the adapted model's logits.

An `s3://` output (`export_to`) is written locally first, in a temporary directory under the S3
cache (APPLIANCE_S3_CACHE: the disk sized for models), then uploaded file by file, its
config.json last, so a reader that finds config.json finds the weights beside it; a prefix
that already holds objects is refused before anything is merged.

Memory: tensors are read and written one output shard at a time (a shard holds whole blocks, up
to `max_shard_bytes`), so host memory holds one shard, never the whole model. Safety: everything
is written into a temporary directory beside the output, which is renamed into place only when
complete; a crash leaves no half-written checkpoint under the output's name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from appliance.adapter import model_card
from appliance.adapter.scratch import clean_dead, scratch_dir
from appliance.errors import NO_SPACE, OTHER, ConfigError, ModelError, StorageError, first_line
from appliance.models import (
    EXPERT_MODULES,
    expert_layout,
    experts_transposed,
    hf_checkpoint,
    moe,
)
from appliance.models.lora import ADAPTER_CONFIG, LoraWeights, load_adapter
from appliance.storage import uri as storage
from appliance.storage.localize import OTHER_WEIGHT_FILES, cache_root
from appliance.storage.output_lock import LOCK_FILE, S3Lease

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
# the base model's files that are weights (the export writes its own): every other file at the
# top of the model directory is copied as it is
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", *OTHER_WEIGHT_FILES)
#: in an s3:// --output while an export uploads it: what a killed export left is known by it
EXPORT_MARKER = ".appliance-export-uploading"
_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}  # else 1
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_output(output: Path) -> None:
    blocker = next((p for p in (output, *output.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == output else f"is under {blocker}, a file"
        raise ModelError(
            f"--output {output} {where}; choose a new directory (export never overwrites)"
        )
    if output.exists() and any(output.iterdir()):
        raise ModelError(
            f"--output {output} already exists and is not empty; choose a new directory "
            "(export never overwrites)"
        )


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# how safetensors' Rust writer words a full disk (its error carries no errno)
_DISK_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def _writing(output: Path, needed: int) -> Iterator[None]:
    """An OSError or SafetensorError while writing the export becomes one StorageError naming
    --output and the cause (a full disk said as such, with the bytes the export needs), as
    `train`'s checkpoint writes say theirs (storage._local_error)."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        full = getattr(e, "errno", None) in _DISK_FULL or any(w in str(e) for w in _DISK_FULL_WORDS)
        if full:
            raise StorageError(
                f"--output {output}: no space left on device while writing the merged "
                f"checkpoint (it needs about {_size(needed)}); free space there or give "
                "--output on a bigger disk (nothing half-written is left)",
                str(output),
                NO_SPACE,
            ) from e
        cause = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        name = str(getattr(e, "filename", None) or "")
        partial = str(output.parent / f".{output.name}.partial-")  # removed: not worth naming
        where = f" ({name})" if name and not name.startswith(partial) else ""
        raise StorageError(
            f"--output {output}: writing the merged checkpoint failed: {cause}{where}; "
            "fix that or give another --output (nothing half-written is left)",
            str(output),
            OTHER,
        ) from e


def _tensor_bytes(ckpt: hf_checkpoint.SafetensorsCheckpoint) -> dict[str, int]:
    """Stored size of every tensor, from the safetensors headers (no tensor is read)."""
    return {
        name: math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)
        for name, (shape, dtype) in ckpt.headers().items()
        if name in ckpt.files
    }


def _drop_quantization_config(config_json: Path) -> None:
    """config.json without its quantization_config (the export holds dequantized weights)."""
    config = json.loads(config_json.read_text())
    config.pop("quantization_config", None)
    config_json.write_text(json.dumps(config, indent=2) + "\n")


def plan_shards(names_bytes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards in model order, never splitting a block across shards.

    Order: embeddings, blocks 0..L-1, everything else (final norm, LM head). A unit bigger
    than `max_shard_bytes` gets a shard of its own.
    """
    units: dict[object, list[str]] = {}
    for name in names_bytes:
        m = _LAYER.match(name)
        key: object = ("block", int(m.group(1))) if m else ("global", name)
        units.setdefault(key, []).append(name)

    def order(key):
        kind, v = key
        if kind == "block":
            return (1, v, "")
        return (0 if "embed_tokens" in v else 2, 0, v)

    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key in sorted(units, key=order):
        group = sorted(units[key])
        n = sum(names_bytes[x] for x in group)
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current += group
        size += n
    if current:
        shards.append(current)
    return shards


def _merge(tensors: dict[str, torch.Tensor], lora: LoraWeights) -> int:
    """Fold the adapter into the adapted weights among `tensors`, in place; returns how many."""
    merged = 0
    for i, block in enumerate(lora.blocks):
        for module, (A, B) in block.items():
            if module in EXPERT_MODULES:
                merged += _merge_experts(tensors, lora, i, module)
                continue
            name = f"model.layers.{i}.{module}.weight"
            if name not in tensors:
                continue
            W = tensors[name]
            delta = (B.detach().float().cpu() @ A.detach().float().cpu()) * lora.spec.scale
            tensors[name] = (W.float() + delta).to(W.dtype)  # (out, in)
            merged += 1
    return merged


def _merge_experts(tensors: dict[str, torch.Tensor], lora: LoraWeights, i: int, module: str) -> int:
    """Fold LoRA on block i's experts (PEFT's layout for the fused tensors: moe.expert_lora)
    into the experts' weights as the checkpoint stores them: apart (gate_up's update's first I
    rows into the gate weight, the others into the up weight; down's into the down weight),
    or fused: transposed (gpt-oss, (E, in, out)) or not (Gemma 4, Qwen3.5-MoE as released:
    (E, out, in)). Returns 1 when the block's experts are among `tensors`,
    else 0."""
    args = lora.args
    layout = expert_layout(args)
    A, B = (p.detach().float().cpu() for p in lora.blocks[i][module])
    prefix = f"model.layers.{i}."
    if layout is None:  # fused as the files store them
        transposed = experts_transposed(args)
        name = prefix + module
        if name not in tensors:
            return 0
        W = tensors[name]
        merged = W.float()
        for j in range(args.num_experts):
            Bj, Aj = moe.expert_lora((A, B), j, args.num_experts)
            delta = (Bj @ Aj) * lora.spec.scale  # (out, in)
            merged[j] += delta.T if transposed else delta
        tensors[name] = merged.to(W.dtype)
        return 1
    if prefix + layout.down.format(0) not in tensors:
        return 0
    for j in range(args.num_experts):
        Bj, Aj = moe.expert_lora((A, B), j, args.num_experts)
        delta = (Bj @ Aj) * lora.spec.scale  # (out, in)
        if module == moe.GATE_UP:
            parts = zip((layout.gate, layout.up), delta.chunk(2), strict=True)
        else:
            parts = [(layout.down, delta)]
        for pattern, d in parts:
            name = prefix + pattern.format(j)
            W = tensors[name]
            tensors[name] = (W.float() + d).to(W.dtype)
    return 1


def export_to(
    model_dir: str | Path,
    adapter_dir: str | Path,
    output: str,
    shown_as: tuple[str, str] | None = None,
) -> None:
    """`export_merged` to `output`: a local directory, or an s3:// prefix (written locally, then
    uploaded: see the module's docstring)."""
    if not storage.is_s3(output):
        export_merged(model_dir, adapter_dir, output, shown_as=shown_as)
        return

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    with contextlib.ExitStack() as stack:
        try:  # one export (or train) writes a prefix at a time: the lease says which, and when
            stack.enter_context(S3Lease(output, say))  # its holder was killed (not renewed)
        except ConfigError:
            raise ConfigError(
                f"--output {output} is being written by another appliance export (its lease is "
                "renewed): wait for it to end, or choose another prefix"
            ) from None
        found = [f for f in storage.list_files(output) if f != LOCK_FILE]
        if EXPORT_MARKER in found and "config.json" not in found:  # a killed export's upload
            for f in sorted(found, key=lambda f: f == EXPORT_MARKER):  # the marker last
                storage.delete(storage.join(output, f))
            say(f"removed {len(found)} objects under {output}: a killed export's upload")
        elif found:
            raise ConfigError(
                f"--output {output} already holds objects; choose a new prefix (export never "
                "overwrites)"
            )
        root = cache_root()
        root.mkdir(parents=True, exist_ok=True)
        _clean_dead(root)  # the local copies killed exports left, never a live one's
        tmp = stack.enter_context(scratch_dir(root, ".export"))
        # first: what a killed export leaves is known as such (and cleaned by the next one)
        storage.write_bytes(storage.join(output, EXPORT_MARKER), b"an appliance export uploads\n")
        local = export_merged(model_dir, adapter_dir, tmp / "merged", shown_as=shown_as)
        files = sorted(f for f in local.rglob("*") if f.is_file())
        files.sort(key=lambda f: f.name == "config.json")  # last: the model is complete then
        for f in files:
            storage.upload_file(f, storage.join(output, f.relative_to(local).as_posix()))
        storage.delete(storage.join(output, EXPORT_MARKER))


def export_merged(
    model_dir: str | Path,
    adapter_dir: str | Path,
    output_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    shown_as: tuple[str, str] | None = None,
) -> Path:
    """Write `model_dir` with `adapter_dir` merged in as a new HF checkpoint at `output_dir`.
    `shown_as`: the model and adapter as the user gave them (an s3:// URI, not its local copy), for
    the model card."""
    model_dir, adapter_dir, output = Path(model_dir), Path(adapter_dir), Path(output_dir)
    _check_output(output)
    args = hf_checkpoint.read_model_args(model_dir)
    ckpt = hf_checkpoint.SafetensorsCheckpoint(model_dir)
    lora = load_adapter(adapter_dir, args)
    sizes = _tensor_bytes(ckpt)
    shards = plan_shards(sizes, max_shard_bytes)
    needed = sum(sizes.values())  # about what the export writes: the merged weights

    with contextlib.ExitStack() as stack:
        with _writing(output, needed):
            output.parent.mkdir(parents=True, exist_ok=True)
            _clean_dead(output.parent)  # what a killed export left here, never a live one's
            # beside the output (same filesystem, so the final rename is atomic), its lock held
            # while this export runs (scratch.py); removed at the end unless renamed into place
            tmp = stack.enter_context(scratch_dir(output.parent, f".{output.name}.partial"))
        weight_map: dict[str, str] = {}
        total_bytes, merged = 0, 0
        for k, names in enumerate(shards):
            fname = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors = ckpt.read(names, dtype=None)  # as stored: merged weights keep their dtype
            merged += _merge(tensors, lora)
            tensors = {ckpt.stored_name(n): t.contiguous() for n, t in tensors.items()}
            with _writing(output, needed):
                save_file(tensors, tmp / fname, metadata={"format": "pt"})
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, fname))
            del tensors
        expected = sum(len(b) for b in lora.blocks)
        if merged != expected:  # load_adapter checked shapes, so this means missing weights
            raise ModelError(f"{model_dir}: only {merged} of {expected} adapted weights found")
        model_name, adapter_name = shown_as or (str(model_dir), str(adapter_dir))
        base = model_card.base_model(model_name, files=model_dir)
        card = model_card.merged_card(
            base,
            adapter_name,
            json.loads((adapter_dir / ADAPTER_CONFIG).read_text()),
            model_card.completed_record(adapter_dir) or model_card.checkpoint_record(adapter_dir),
            str(output_dir),
        )
        with _writing(output, needed):
            if len(shards) > 1:
                index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            for f in sorted(model_dir.iterdir()):
                if (
                    f.is_file()
                    and not any(f.match(w) for w in WEIGHT_FILES)
                    and f.name != model_card.CARD
                ):
                    shutil.copy2(f, tmp / f.name)
            if ckpt.packed:  # MXFP4 experts were written dequantized: a plain checkpoint
                _drop_quantization_config(tmp / "config.json")
            (tmp / model_card.CARD).write_text(card)
            mode = storage.file_mode()  # save_file makes 0600, copy2 copies the model's mode
            for f in tmp.iterdir():
                f.chmod(mode)  # every file of the export follows the umask, as train's do
            _check_output(output)  # someone may have written there meanwhile
            if output.exists():
                output.rmdir()  # empty: replace it
            os.rename(tmp, output)
    return output


def _clean_dead(parent: Path) -> None:
    """Remove the scratch directories killed exports left in `parent`, saying so."""
    for dead in clean_dead(parent):
        print(f"removed {dead}: left by an export that was killed", file=sys.stderr)
