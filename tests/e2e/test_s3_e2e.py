"""Model, dataset and output all on s3:// (a real moto S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load, load_file

from appliance.adapter.export import export_merged
from appliance.run.record import model_fingerprint
from appliance.storage import uri as storage
from appliance.storage.checkpoints import FAULT_ENV, list_checkpoints, load_latest_checkpoint
from tests.e2e.test_faults import Proc
from tests.helpers_model import load_hf, make_model
from tests.helpers_net import free_port
from tests.helpers_tokenizer import sentences

pytest_plugins = ["tests.s3_server"]
pytestmark = pytest.mark.integration

# `python -m appliance` with S3Lease.STALE_S set to 3 s: a driver that waits out a dead run's
# lease takes it over after 3 s without a renewal instead of 45 s
STALE_S_HERE = [
    sys.executable,
    "-c",
    "import sys; from appliance.storage.output_lock import S3Lease; S3Lease.STALE_S = 3.0; "
    "sys.argv = ['appliance', *sys.argv[1:]]; "
    "from appliance.__main__ import entry; entry()",
]


def upload_dir(local, uri):
    for path in sorted(local.rglob("*")):
        if path.is_file():
            storage.upload_file(str(path), storage.join(uri, str(path.relative_to(local))))


def cached_files(home) -> dict[str, tuple[int, int]]:
    """What the S3 cache under `home` holds: path → (inode, mtime_ns) of every file."""
    root = home / ".cache" / "appliance" / "s3"
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and ".etags" not in p.parts
    }


def test_model_data_and_output_on_s3_survive_a_torn_checkpoint_write_and_resume_exactly(
    s3_endpoint, s3_bucket, tmp_path
):
    model = make_model(tmp_path / "model", "qwen2-bias", shards=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(80)))
    upload_dir(model, f"s3://{s3_bucket}/models/tiny")
    storage.upload_file(str(data), f"s3://{s3_bucket}/data/train.jsonl")
    home = tmp_path / "home"  # the S3 cache goes under $HOME/.cache/appliance/s3

    def argv(out, *extra):
        return [
            sys.executable,
            "-m",
            "appliance",
            "train",
            "--model",
            f"s3://{s3_bucket}/models/tiny",
            "--data",
            f"s3://{s3_bucket}/data/train.jsonl",
            "--output",
            out,
            "--steps",
            "6",
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

    env = {**os.environ, "HOME": str(home)}
    out = f"s3://{s3_bucket}/runs/a"

    # 1. killed (SIGKILL) while writing the step-4 checkpoint to S3, after its first file
    rc, _, err = Proc(argv(out), env={**env, FAULT_ENV: "4"}).finish()
    assert rc == -signal.SIGKILL, err[-3000:]
    assert load_latest_checkpoint(out).step == 2  # the torn step-4 checkpoint is not published
    assert [c.step for c in list_checkpoints(out) if c.complete] == [2]
    cache = cached_files(home)
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    assert len(shards) > 1
    assert sorted(name.rsplit("/", 1)[-1] for name in cache if name.endswith(".safetensors")) == (
        shards
    )  # the model is on local disk once: one copy of each shard, in the cache

    # 2. --resume continues from step 2 on S3 and finishes, once the lease the killed run left
    # has gone unrenewed for S3Lease.STALE_S: that run is gone, not another one writing. The
    # resuming driver waits 3 s of it, not 45 s (STALE_S_HERE): the length proves nothing here,
    # and the takeover on its own is test_output_lock's test_the_lease_of_a_run_that_died_...
    # 3. beside it (started now, checked below), an uninterrupted run: the resumed one must
    # have its losses and its adapter
    ref = f"s3://{s3_bucket}/runs/ref"
    reference_run = Proc(argv(ref), env=env)
    resume = [*STALE_S_HERE, *argv(out, "--resume")[3:]]
    rc, _, err = Proc(resume, env=env).finish()
    assert rc == 0, err[-3000:]
    assert f"--output {out}: took over the lease of pid " in err
    assert "resumed from step-000002" in err
    resumed = json.loads(storage.read_bytes(storage.join(out, "run.json")))
    assert resumed["status"] == "complete" and resumed["steps"] == 6
    # its model card, on S3 too, tells the whole run (the losses before the resume included)
    card = storage.read_bytes(storage.join(out, "README.md")).decode()
    assert f"A LoRA adapter (PEFT format) for `s3://{s3_bucket}/models/tiny`" in card
    assert "| data | `train.jsonl`, packed by documents |" in card
    assert "| steps | 6 (" in card and "at step 1, " in card and " at step 6 |" in card
    # the model on S3 is fingerprinted from its local copy, as the same files on disk would be:
    # a resume may follow it to another prefix or to a local path
    assert resumed["model_fingerprint"] == model_fingerprint(str(model))

    # 3. the uninterrupted run: the resumed one has its losses and its adapter
    rc, _, err = reference_run.finish()
    assert rc == 0, err[-3000:]
    reference = json.loads(storage.read_bytes(storage.join(ref, "run.json")))
    np.testing.assert_allclose(resumed["losses"], reference["losses"], rtol=1e-6)
    a, b = (
        load(storage.read_bytes(storage.join(uri, "adapter_model.safetensors")))
        for uri in (out, ref)
    )
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)

    # the two later runs found the model and data in the cache: nothing downloaded again
    assert cached_files(home) == cache

    # the adapter on S3 loads with peft onto the transformers model
    local = tmp_path / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        storage.download_file(storage.join(out, name), str(local / name))
    peft_model = PeftModel.from_pretrained(load_hf(model), local)
    with torch.no_grad():
        assert torch.isfinite(peft_model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits).all()

    # 4. export onto S3: the merged model is in the bucket (it went into a local directory
    # named `s3:`, and the command said it was written to S3), and its weights are the local
    # export's; a second export there is refused, naming the URI as given
    merged = f"s3://{s3_bucket}/merged/a"
    export = [sys.executable, "-m", "appliance", "export", "--adapter", out, "--output", merged]
    done = subprocess.run(
        export, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"(from {out}/run.json)" in done.stderr  # not its local copy's path
    assert not (tmp_path / "s3:").exists()
    names = storage.list_files(merged)
    assert "config.json" in names and "README.md" in names
    here = tmp_path / "merged-here"
    export_merged(model, local, here)
    assert sorted(names) == sorted(p.name for p in here.iterdir())
    for name in (n for n in names if n.endswith(".safetensors")):
        ours, theirs = load(storage.read_bytes(storage.join(merged, name))), load_file(here / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = subprocess.run(
        export, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 1
    assert f"error: --output {merged} already holds objects" in again.stderr


def test_a_missing_bucket_is_named_in_one_line(s3_endpoint, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "appliance",
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


def test_validation_on_a_cluster_fetches_the_tokenizer_where_the_driver_runs(
    s3_bucket, s3_client, tmp_path, monkeypatch
):
    """With --cluster the driver (on the Ray head) builds the validation set, but the inputs
    were resolved on a trainer node: their tokenizer path is in that node's S3 cache. The
    driver fetches the tokenizer from the model's URI into its own cache, as the tokenizer
    workers do."""
    from appliance.adapter.evaluate import validation_batches
    from appliance.config import build_config
    from appliance.run.state import Inputs
    from tests.helpers_tokenizer import make_tokenizer

    _, _, eos, pad = make_tokenizer(tmp_path / "model")
    s3_client.put_object(
        Bucket=s3_bucket,
        Key="m/tokenizer.json",
        Body=(tmp_path / "model" / "tokenizer.json").read_bytes(),
    )
    lines = "".join(json.dumps({"text": t}) + "\n" for t in sentences(40))
    s3_client.put_object(Bucket=s3_bucket, Key="d/train.jsonl", Body=lines.encode())
    cfg = build_config(
        {},
        {
            "model": f"s3://{s3_bucket}/m",
            "data": f"s3://{s3_bucket}/d/train.jsonl",
            "output": str(tmp_path / "out"),
            "eval_split": "0.25",
            "seq_len": "16",
            "micro_batch_size": "2",
        },
    )
    monkeypatch.setenv("APPLIANCE_S3_CACHE", str(tmp_path / "head-cache"))
    trainer_node = tmp_path / "trainer-cache" / s3_bucket / "m"  # not on this machine
    inp = Inputs(cfg, trainer_node, tmp_path / "x", eos, pad, "cpu", "f32")
    batches = validation_batches(cfg, inp)
    assert batches and sum(int((b.labels != -100).sum()) for b in batches) > 0
    assert (tmp_path / "head-cache" / s3_bucket / "m" / "tokenizer.json").is_file()
