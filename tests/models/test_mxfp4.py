"""gpt-oss checkpoints whose experts are stored in MXFP4 as released (`*_blocks` + `*_scales`,
quant_method mxfp4) are dequantized on load (models/mxfp4.py, hf_checkpoint, the weight store),
exactly as transformers' own dequantization (`convert_moe_packed_tensors`), and train."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from appliance.actors.weight_store import local_source, store_nbytes
from appliance.adapter.export import export_merged
from appliance.engine.step import StreamedEngine
from appliance.errors import ModelError
from appliance.models import mxfp4
from appliance.models.hf_checkpoint import SafetensorsCheckpoint, read_model_args
from appliance.models.lora import LoraSpec, LoraWeights
from tests.helpers_model import batch, load_hf, make_model, rel_err

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, in, out) → MXFP4 blocks (E, out, in/32, 16) and scales (E, out, in/32), the layout
    of gpt-oss's released files (transformers' convert_moe_packed_tensors reads it back): per 32
    values along `in`, the power of two that puts the largest under 6, and each value's nearest
    E2M1 code, two a byte, the even one in the low nibble."""
    E, n_in, n_out = w.shape
    groups = w.transpose(1, 2).float().reshape(E, n_out, n_in // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    lut = torch.tensor(FP4_VALUES)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exp)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_model(directory: Path) -> Path:
    """A tiny gpt-oss model with its experts stored in MXFP4, as released (sizes multiples of
    32; the attention, router, norms and biases kept as they are)."""
    model_dir = make_model(directory, "gpt-oss", intermediate_size=32, with_tokenizer=False)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(tensors.pop(name))
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def transformers_dequantized(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """name → transformers' dequantization of every MXFP4 tensor of the files."""
    stored = load_file(model_dir / "model.safetensors")
    return {
        name[: -len("_blocks")]: convert_moe_packed_tensors(
            t, stored[name[: -len("_blocks")] + "_scales"], dtype=dtype
        )
        for name, t in stored.items()
        if name.endswith("_blocks")
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(dtype, tmp_path):
    """The weight store's buffers and the checkpoint reader both hold transformers'
    dequantization bit for bit; the store holds them in the compute dtype (its size as the
    shapes alone say), and the headers present each as one tensor of the dequantized shape."""
    model_dir = mxfp4_model(tmp_path / "model")
    args = read_model_args(model_dir)  # accepted: quant_method mxfp4
    ckpt = SafetensorsCheckpoint(model_dir)
    ckpt.check(args)
    torch_dtype = getattr(torch, dtype)
    theirs = transformers_dequantized(model_dir, torch_dtype)
    assert len(theirs) == 2 * args.num_layers
    assert not any(n.endswith(("_blocks", "_scales")) for n in ckpt.files)

    source = local_source(model_dir, dtype)
    for name, expected in theirs.items():
        i, short = int(name.split(".")[2]), name.split(".", 3)[3]
        assert torch.equal(source.block(i)[short], expected), name
        assert torch.equal(ckpt.read([name], torch_dtype)[name], expected), name
    nbytes = sum(b.nbytes for b in source.block_bufs) + sum(b.nbytes for b in source.global_bufs)
    assert nbytes == store_nbytes(args, dtype)


def test_a_gpt_oss_model_stored_in_mxfp4_trains_and_exports(tmp_path):
    """A training step on the MXFP4 checkpoint (through the weight store) equals one on the
    same model saved dequantized by transformers (its loss and every LoRA gradient, bit for
    bit); the merged export is a plain checkpoint (no quantization_config) that transformers
    loads with the engine's logits."""
    mx_dir = mxfp4_model(tmp_path / "mx")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    tensors = load_file(mx_dir / "model.safetensors")
    tensors = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    tensors.update(transformers_dequantized(mx_dir, torch.float32))
    save_file(tensors, plain_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx_dir / "config.json").read_text())
    del config["quantization_config"]
    (plain_dir / "config.json").write_text(json.dumps(config))

    spec = LoraSpec(rank=2, alpha=4.0, targets=("q", "v", "experts"))
    ids, labels = batch(4, 16, seed=3)
    micro = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    results = []
    for model_dir in (mx_dir, plain_dir):
        lora = LoraWeights(read_model_args(model_dir), spec, seed=5)
        engine = StreamedEngine(local_source(model_dir, "float32"), lora)
        loss = engine.train_step(micro, lr=5e-2).loss
        results.append((loss, lora, engine))
    (loss, lora, engine), (plain_loss, plain_lora, _) = results
    assert math.isfinite(loss) and loss == plain_loss
    for block, plain in zip(lora.blocks, plain_lora.blocks, strict=True):
        for name, (A, B) in block.items():
            assert torch.equal(A, plain[name][0]) and torch.equal(B, plain[name][1]), name

    lora.save(tmp_path / "adapter")
    out = export_merged(mx_dir, tmp_path / "adapter", tmp_path / "merged")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ids, _ = batch(2, 12, seed=9)
    with torch.no_grad():
        merged = load_hf(out)(input_ids=ids).logits.float()
        peft = PeftModel.from_pretrained(load_hf(plain_dir), tmp_path / "adapter").eval()
        theirs = peft(input_ids=ids).logits.float()
    assert rel_err(engine.logits(ids), theirs) < 1e-5
    assert rel_err(merged, theirs) < 1e-5


def test_mxfp4_parts_not_in_the_released_layout_are_named(tmp_path):
    model_dir = mxfp4_model(tmp_path / "model")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :0].contiguous()  # a scale per 32 values missing
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="model.layers.1.mlp.experts.down_proj: MXFP4 blocks"):
        SafetensorsCheckpoint(model_dir).check(read_model_args(model_dir))


def test_dequantize_writes_one_expert_at_a_time_into_its_destination():
    w = torch.randn(3, 64, 40)
    blocks, scales = quantize(w)
    dest = torch.empty(3, 64, 40, dtype=torch.bfloat16)
    assert mxfp4.dequantize(blocks, scales, torch.bfloat16, out=dest) is dest
    assert torch.equal(dest, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    assert rel_err(dest.float(), w) < 0.2  # 4-bit codes: the model's weights, roughly
