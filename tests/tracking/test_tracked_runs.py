"""`--report-to` (issue 45, item 1): a run's figures in TensorBoard, MLflow and W&B, read back
with each one's own reader, equal history.jsonl's; a resumed run continues the same tracked runs.
One run and one resume cover every backend, in this process on the shared Ray (`ray_local`; once
tests/e2e/, two `appliance train` children): what is asserted is what the trackers hold, not how
a process ends."""

from __future__ import annotations

import json
import struct

import numpy as np

from appliance.run.history_log import read_history
from tests.helpers_cli import train_in_process
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences


def wandb_history(path) -> list[dict]:
    """The history rows of a W&B run file (run-ID.wandb): W&B's LevelDB-style log of 32 KiB
    blocks of records (7-byte headers: crc32, length, FULL=1/FIRST=2/MIDDLE=3/LAST=4), each a
    wandb_internal_pb2.Record. wandb 0.31 ships no Python reader of it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_trackers_hold_the_history_and_a_resumed_run_continues_them(
    ray_local, tmp_path, monkeypatch
):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(60)))
    out, store = tmp_path / "o", f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's own variables, read as such
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = train_in_process("--model", model, "--data", data, "--output", out, "--steps", "4",
                             "--eval-split", "0.2", "--eval-every", "2", "--checkpoint-every", "2",
                             "--seq-len", "16", "--micro-batch-size", "2", "--tokenize-workers", "1",
                             "--report-to", "tensorboard,mlflow", "--report-to", "wandb",
                             "--mlflow-tracking-uri", store, "--mlflow-experiment-name", "tiny",
                             "--wandb-project", "tiny")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    ids = json.loads((out / "run.json").read_text())["tracking"]
    more = train_in_process("--output", out, "--resume", "--steps", "6")
    assert more.returncode == 0, more.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["tracking"] == ids  # the same tracked runs, continued

    history = read_history(str(out))
    train = [r for r in history if "loss" in r]
    evals = [r for r in history if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and len(evals) == 3
    assert [r["loss"] for r in train] == record["losses"]

    # TensorBoard's own reader: float32 scalars, the history's losses to float32's last digit
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    tb = events.Scalars("train/loss")
    assert [e.step for e in tb] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in tb] == [np.float32(r["loss"]) for r in train]
    assert [e.value for e in events.Scalars("eval/loss")] == [
        np.float32(r["eval_loss"]) for r in evals
    ]
    assert [e.step for e in events.Scalars("train/learning_rate")] == [1, 2, 3, 4, 5, 6]

    # MLflow: one run, both invocations' steps in it, exactly the history's numbers
    from mlflow import MlflowClient

    client = MlflowClient(store)
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "o"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert losses == [(r["step"], r["loss"]) for r in train]
    evaluated = client.get_metric_history(run.info.run_id, "eval_loss")
    assert sorted((m.step, m.value) for m in evaluated) == [
        (r["step"], r["eval_loss"]) for r in evals
    ]
    assert float(run.data.params["lr"]) == record["config"]["lr"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert "adapter/adapter_model.safetensors" in artifacts
    assert (tmp_path / "mlartifacts" / "tiny").is_dir()  # beside the store, not in the cwd

    # W&B offline: one run directory per invocation, both of the kept run id; their rows
    run_dirs = sorted((out / "wandb").glob(f"offline-run-*-{ids['wandb']['run_id']}"))
    assert len(run_dirs) == 2
    rows = [r for d in run_dirs for r in wandb_history(d / f"run-{ids['wandb']['run_id']}.wandb")]
    logged = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert logged == {r["step"]: r["loss"] for r in train}
    assert {r["_step"] for r in rows if "eval/loss" in r} == {2, 4, 6}
