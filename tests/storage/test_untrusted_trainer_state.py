"""A tampered trainer_state.pt (its manifest rewritten to match) is not trusted: the resume says
so in one line and falls back to the previous checkpoint, as for a corrupt one (issue 44, item
8). It was a 67-line traceback advising `weights_only=False`.

Both runs go in this process, on the shared Ray (`ray_local`): what is asserted is what the
resume says and does, not how its process ends (once tests/e2e/, two `appliance train` children:
tests/e2e/test_faults.py's corrupt checkpoint is still resumed by a child)."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
from pathlib import Path

import torch

from appliance.storage.checkpoints import MANIFEST
from tests.helpers_cli import train_in_process
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences


def tamper(step_dir: Path) -> None:
    """Replace the trainer state with a pickle of something else, and the manifest's entry to
    match it: the checksums pass, the content is not a trainer's."""
    buf = io.BytesIO()
    torch.save({"lora": {}, "rng": datetime.datetime(2026, 1, 1)}, buf)
    data = buf.getvalue()
    (step_dir / "trainer_state.pt").write_bytes(data)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["name"] == "trainer_state.pt":
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def test_a_tampered_trainer_state_falls_back_to_the_previous_checkpoint(
    ray_local, tmp_path, caplog
):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(30)))
    out = tmp_path / "o"
    common = ("--seq-len", "16", "--micro-batch-size", "2", "--tokenize-workers", "1")
    first = train_in_process("--model", model, "--data", data, "--output", out, "--steps", "2",
                             "--checkpoint-every", "1", *common)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    tamper(out / "checkpoints" / "step-000002")

    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the fallback's warning: stderr, in a child
        resumed = train_in_process("--output", out, "--resume", "--steps", "3")
    text = resumed.stdout + resumed.stderr + caplog.text
    assert resumed.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "weights_only=False" not in text
    warned = [line for line in text.splitlines() if "step-000002/trainer_state.pt" in line]
    assert len(warned) == 1 and "not trusted" in warned[0], text[-3000:]
    assert "resumed from step-000001" in text
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
