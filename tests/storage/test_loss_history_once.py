"""The run's loss history is kept once, appended (issue 44, item 14): run.json and every
checkpoint's driver state carried every step's loss, so checkpoint I/O grew with the square of
the steps. Now each checkpoint writes only the losses since the one before, as a segment of
OUTPUT/checkpoints/history/, and a resume reads the chain back."""

from __future__ import annotations

import json
import re

from appliance.run.history_log import read_history
from appliance.storage.history import read_chain
from tests.helpers_cli import train_in_process
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences


def test_checkpoints_carry_only_their_share_of_the_history_and_a_resume_reads_it_all(
    ray_local, tmp_path
):
    """In this process, on the module's Ray: the files the runs leave are what it is about."""
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(60)))
    out = tmp_path / "o"
    first = train_in_process("--model", model, "--data", data, "--output", out, "--steps", "12",
                  "--checkpoint-every", "1", "--keep-checkpoints", "12", "--seq-len", "16",
                  "--micro-batch-size", "2", "--tokenize-workers", "1",
                  "--warmup-ratio", "0.25")  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # the run says what it reads and how long it is (issue 45, item 3)
    said = first.stdout
    assert "data: 60 documents, " in said and " tokens read" in said
    assert "run: 12 steps of 8 rows of 16 tokens, " in said
    assert "; warm-up 3 steps (--warmup-ratio 0.25)" in said
    assert re.search(r"^step 1/12  loss .*  restarts 0  epoch 0\.\d\d$", said, re.M)  # its epoch
    losses = json.loads((out / "run.json").read_text())["losses"]
    assert len(losses) == 12
    sizes = {}
    for step in (1, 6, 12):
        path = out / "checkpoints" / f"step-{step:06d}" / "driver_state.json"
        state = json.loads(path.read_text())
        assert state["losses"] == [] and state["history_steps"] == step
        chain, _ = read_chain(str(out / "checkpoints"), state["history"], step)
        assert chain == losses[:step]  # each checkpoint's own history, whole
        sizes[step] = path.stat().st_size
    assert sizes[12] - sizes[1] < 64  # it no longer grows ~20 bytes a step
    segments = list((out / "checkpoints" / "history").iterdir())
    assert len(segments) == 12
    assert sum(len(json.loads(s.read_text())["losses"]) for s in segments) == 12  # once each

    # history.jsonl beside run.json: a line per step, the same losses, HF's key names
    history = read_history(str(out))
    assert [r["step"] for r in history] == list(range(1, 13))
    assert [r["loss"] for r in history] == losses
    assert all(r["learning_rate"] > 0 and r["tokens_per_second"] > 0 for r in history)
    assert all("grad_norm" in r and r["host_memory_bytes"] > 0 for r in history)
    rates = [r["learning_rate"] for r in history]  # --warmup-ratio 0.25 of 12: the peak at 3
    assert rates[2] == max(rates) == 2e-4 and rates[1] < rates[2]
    epochs = [r["epoch"] for r in history]
    assert epochs == sorted(epochs) and epochs[0] > 0
    # a driver killed after logging step 13 but before its checkpoint, mid-way through a line
    with open(out / "history.jsonl", "a") as f:
        f.write(json.dumps({"step": 13, "loss": 99.0}) + "\n" + '{"step": 14, "lo')

    more = train_in_process("--output", out, "--resume", "--steps", "15", "--warmup-ratio", "1")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "warning: the warm-up (15 steps) is as long as the run (15 steps)" in more.stdout
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["status"] == "complete" and len(resumed["losses"]) == 15
    assert resumed["losses"][:12] == losses
    assert "history.jsonl: 1 step(s) after step 12 left out (they are trained again)" in (
        more.stdout
    )
    history = read_history(str(out))  # each step once: 13 trained again, the torn line gone
    assert [r["step"] for r in history] == list(range(1, 16))
    assert [r["loss"] for r in history] == resumed["losses"]
