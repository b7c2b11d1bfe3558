"""Model, dataset and output all on s3:// (a real moto S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import PeftModel

from appliance import storage
from appliance.checkpoint import load_latest_checkpoint
from tests.helpers_model import load_hf, make_model
from tests.helpers_tokenizer import sentences
from tests.test_faults import free_port

pytest_plugins = ["tests.s3_server"]
pytestmark = pytest.mark.integration


def upload_dir(local, uri):
    for path in sorted(local.rglob("*")):
        if path.is_file():
            storage.upload_file(str(path), storage.join(uri, str(path.relative_to(local))))


def test_train_reads_model_and_data_from_s3_and_writes_adapter_and_checkpoints_there(
    s3_endpoint, s3_bucket, tmp_path
):
    model = make_model(tmp_path / "model", "qwen2-bias", shards=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(80)))
    upload_dir(model, f"s3://{s3_bucket}/models/tiny")
    storage.upload_file(str(data), f"s3://{s3_bucket}/data/train.jsonl")
    out = f"s3://{s3_bucket}/runs/a"

    def train(*extra):
        argv = [
            sys.executable,
            "-m",
            "appliance.cli",
            "train",
            "--model",
            f"s3://{s3_bucket}/models/tiny",
            "--data",
            f"s3://{s3_bucket}/data/train.jsonl",
            "--output",
            out,
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--seq-len",
            "16",
            "--micro-batch-size",
            "2",
            "--lora-rank",
            "4",
            "--tokenize-workers",
            "1",
            "--log-format",
            "json",
            "--metrics-port",
            str(free_port()),
            *extra,
        ]
        env = {**os.environ, "HOME": str(tmp_path / "home")}  # the s3 cache goes under $HOME
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    done = train()
    assert done.returncode == 0, done.stderr[-3000:]
    names = storage.list_files(out)
    assert {"adapter_config.json", "adapter_model.safetensors", "run.json"} <= set(names)
    assert "checkpoints/latest" in names
    ckpt = load_latest_checkpoint(out)
    assert ckpt.step == 4 and "trainer_state.pt" in ckpt.files  # checksums verified on load

    # the adapter on S3 loads with peft onto the transformers model
    local = tmp_path / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        storage.download_file(storage.join(out, name), str(local / name))
    peft_model = PeftModel.from_pretrained(load_hf(model), local)
    with torch.no_grad():
        assert torch.isfinite(peft_model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits).all()

    # the model was cached locally once, not twice: the second run's --resume reuses the cache
    again = train("--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-000004" in again.stderr
    assert json.loads(storage.read_bytes(storage.join(out, "run.json")))["status"] == "complete"


def test_a_missing_bucket_is_named_in_one_line(s3_endpoint, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "appliance.cli",
        "train",
        "--model",
        "s3://no-such-bucket/m",
        "--data",
        "s3://no-such-bucket/d.jsonl",
        "--output",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)}
    )
    assert done.returncode == 1
    assert "bucket 'no-such-bucket' does not exist" in done.stderr
    assert "Traceback" not in done.stderr
