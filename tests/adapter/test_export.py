"""A merged export loads in plain transformers and gives the logits of base + adapter under peft.

Tolerance: 1e-5 relative error (fp32, CPU), as for the engine's parity tests.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel
from safetensors import SafetensorError, safe_open

from appliance.adapter import export as E
from appliance.cli.main import main
from appliance.errors import NO_SPACE, ModelError, StorageError
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec
from tests.helpers_model import (
    FAMILY_VARIANTS,
    VOCAB,
    load_hf,
    lora_with_random_b,
    make_model,
    rel_err,
)

RTOL = 1e-5


def save_random_adapter(model_dir, out, spec=LoraSpec(rank=4, alpha=8.0), seed=1):
    """An adapter with non-zero B, so merging changes the weights."""
    lora_with_random_b(read_model_args(model_dir), spec, seed=seed).save(out)
    return out


def ids(n_rows=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n_rows, T), generator=g)


def check_export_matches_peft(model_dir, adapter, out):
    x = ids()
    with torch.no_grad():
        merged = load_hf(out)(input_ids=x).logits.float()
        peft = PeftModel.from_pretrained(load_hf(model_dir), adapter).eval()
        theirs = peft(input_ids=x).logits.float()
        base = load_hf(model_dir)(input_ids=x).logits.float()
    assert rel_err(merged, theirs) < RTOL
    assert rel_err(base, theirs) > 1e-3  # the adapter matters: the check has teeth


@pytest.mark.parametrize("variant", ["llama-gqa-rope3-tied", "qwen2-bias", *FAMILY_VARIANTS])
def test_merged_single_file_equals_base_plus_adapter(variant, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    (model_dir / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")
    out = E.export_merged(model_dir, adapter, tmp_path / "out")

    check_export_matches_peft(model_dir, adapter, out)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    for name in ("config.json", "tokenizer.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_sharded_source_to_sharded_export_keeps_dtype_and_unadapted_tensors(tmp_path):
    # a sharded source; the adapter targets q and down only
    model_dir = make_model(tmp_path / "model", "llama-mha", shards=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    block = E._tensor_bytes(E.hf_checkpoint.SafetensorsCheckpoint(model_dir))
    per_block = sum(n for k, n in block.items() if k.startswith("model.layers.0."))
    adapter = save_random_adapter(
        model_dir, tmp_path / "adapter", LoraSpec(rank=2, alpha=4.0, targets=("q", "down"))
    )
    out = E.export_merged(model_dir, adapter, tmp_path / "out", max_shard_bytes=per_block + 1)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    # a block never straddles two shards
    for i in range(cfg["num_hidden_layers"]):
        files = {f for k, f in index["weight_map"].items() if k.startswith(f"model.layers.{i}.")}
        assert len(files) == 1, (i, files)
    check_export_matches_peft(model_dir, adapter, out)

    src = E.hf_checkpoint.SafetensorsCheckpoint(model_dir)
    before = src.read(list(src.files), dtype=None)
    after = E.hf_checkpoint.SafetensorsCheckpoint(out).read(list(src.files), dtype=None)
    assert set(index["weight_map"]) == set(before)
    for name, t in before.items():
        assert after[name].dtype == t.dtype
        adapted = name.endswith(("q_proj.weight", "down_proj.weight")) and "layers" in name
        assert torch.equal(after[name], t) != adapted, name


def test_bf16_checkpoint_is_merged_in_fp32_and_stored_in_bf16(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    bf16 = tmp_path / "bf16"
    load_hf(model_dir).to(torch.bfloat16).save_pretrained(bf16)
    (bf16 / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")
    out = E.export_merged(bf16, adapter, tmp_path / "out")

    name = "model.layers.1.self_attn.v_proj.weight"
    with safe_open(bf16 / "model.safetensors", "pt") as f:
        W = f.get_tensor(name)
    with safe_open(out / "model.safetensors", "pt") as f:
        merged = f.get_tensor(name)
    lora = E.load_adapter(adapter, read_model_args(model_dir))
    A, B = lora.blocks[1]["self_attn.v_proj"]
    expected = (W.float() + (B @ A).detach() * 2.0).to(torch.bfloat16)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, expected)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (bf16 / "config.json").read_text()
    )


def test_refuses_a_non_empty_output_and_names_it(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelError, match=f"--output {out} already exists and is not empty"):
        E.export_merged(model_dir, adapter, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    E.export_merged(model_dir, adapter, out)  # an empty directory is fine
    assert (out / "model.safetensors").is_file()
    afile = tmp_path / "afile"
    afile.write_text("")  # an empty file is no empty directory: named as what it is
    with pytest.raises(ModelError, match=f"--output {afile} is a file"):
        E.export_merged(model_dir, adapter, afile)
    with pytest.raises(ModelError, match=f"--output {afile / 'sub'} is under {afile}, a file"):
        E.export_merged(model_dir, adapter, afile / "sub")
    assert afile.read_text() == ""


def test_a_crash_mid_export_leaves_nothing_behind(tmp_path, monkeypatch):
    model_dir = make_model(tmp_path / "model", "llama-mha", shards=True)
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")
    calls = []
    real = E.save_file

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(E, "save_file", failing_save)
    out = tmp_path / "out"
    with pytest.raises(StorageError, match=f"--output {out}: writing the merged .* disk full;"):
        E.export_merged(model_dir, adapter, out, max_shard_bytes=1)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "model"]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        # what safetensors' writer raises on a full disk (tmpfs, measured): no errno, words only
        SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        ),
    ],
)
def test_a_full_disk_is_one_error_line_naming_the_output(tmp_path, monkeypatch, error):
    """A full disk while writing was a SafetensorError traceback: now one `error:` line naming
    --output, the cause and what to do, as train's full disk (a StorageError); nothing left."""
    model_dir = make_model(tmp_path / "model", "llama-mha")
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")

    def disk_full(tensors, path, metadata=None):
        raise error

    monkeypatch.setattr(E, "save_file", disk_full)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["export", "--model", str(model_dir), "--adapter", str(adapter), "--output", str(out)]
    )
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines() == [
        f"error: --output {out}: no space left on device while writing the merged checkpoint "
        "(it needs about 0.5 MiB); free space there or give --output on a bigger disk (nothing "
        "half-written is left)"
    ]
    with pytest.raises(StorageError) as e:
        E.export_merged(model_dir, adapter, out)
    assert e.value.kind == NO_SPACE and e.value.uri == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "model"]


def test_a_really_full_disk_is_said_so(tmp_path):
    """The same on a real full disk: a 256 KiB tmpfs, smaller than the merged model."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    model_dir = make_model(tmp_path / "model", "llama-mha")
    adapter = save_random_adapter(model_dir, tmp_path / "adapter")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mount -t tmpfs refused here")
    try:
        with pytest.raises(StorageError, match="no space left on device") as e:
            E.export_merged(model_dir, adapter, disk / "out")
        assert e.value.kind == NO_SPACE
        assert list(disk.iterdir()) == []  # the partial copy removed
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_adapter_of_another_model_is_refused(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    other = make_model(tmp_path / "other", "llama-mha", hidden_size=32, intermediate_size=48)
    adapter = save_random_adapter(other, tmp_path / "adapter")
    with pytest.raises(ModelError, match="rank or model mismatch"):
        E.export_merged(model_dir, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_plan_shards_keeps_model_order_and_whole_blocks():
    sizes = {
        "lm_head.weight": 10,
        "model.norm.weight": 1,
        "model.layers.1.a": 4,
        "model.layers.1.b": 4,
        "model.layers.0.a": 4,
        "model.layers.0.b": 4,
        "model.embed_tokens.weight": 10,
    }
    assert E.plan_shards(sizes, 100) == [
        [
            "model.embed_tokens.weight",
            "model.layers.0.a",
            "model.layers.0.b",
            "model.layers.1.a",
            "model.layers.1.b",
            "lm_head.weight",
            "model.norm.weight",
        ]
    ]
    assert E.plan_shards(sizes, 12) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.a", "model.layers.0.b"],
        ["model.layers.1.a", "model.layers.1.b"],
        ["lm_head.weight", "model.norm.weight"],
    ]


@pytest.mark.parametrize("command", ["eval", "export"])
def test_adapter_given_as_its_weights_file_names_the_directory(command, tmp_path, monkeypatch):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    save_random_adapter(model_dir, tmp_path / "runs" / "x")
    monkeypatch.chdir(tmp_path)
    given = ["--adapter", "runs/x/adapter_model.safetensors"]
    rest = {"eval": ["--data", "d.jsonl", "--seq-len", "8"], "export": ["--output", "out"]}
    for model in ([], ["--model", str(model_dir)]):  # the file was refused both ways
        result = CliRunner().invoke(main, [command, *model, *given, *rest[command]])
        assert result.exit_code == 1, result.output
        assert result.output.splitlines() == [
            "error: --adapter must be a directory (the one holding adapter_config.json): "
            "did you mean runs/x?"
        ]
    assert not (tmp_path / "out").exists()
