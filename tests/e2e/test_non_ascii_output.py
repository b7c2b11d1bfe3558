"""A non-ASCII --output (`runs/jürgen`, a home with an accent) trains (issue 44, item 9): the path
became the metrics' `run` label, and Ray's tags must be ASCII, so the run crashed after Ray
started. The label is encoded; the path is not refused."""

from __future__ import annotations

import json

import pytest

from appliance.metrics.recorders import MAX_LABEL, run_label
from tests.helpers_cli import run_train
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences


def test_the_run_label_is_printable_ascii_and_one_per_output():
    labels = {run_label(o) for o in ("runs/jürgen", "runs/jurgen", "runs/jÜrgen", "/home/zoë/o")}
    assert len(labels) == 4
    assert all(label.isascii() and label.isprintable() for label in labels)
    assert run_label("runs/jürgen") == "runs/j%C3%BCrgen"
    assert run_label("s3://bucket/runs/a b") == "s3://bucket/runs/a b"  # ASCII: as it was
    long = [run_label("/r/" + "é" * 300 + tail) for tail in ("a", "b")]
    assert long[0] != long[1] and all(len(label) <= MAX_LABEL for label in long)


@pytest.mark.integration
def test_a_non_ascii_output_trains(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(30)))
    out = tmp_path / "runs" / "jürgen"
    done = run_train("--model", model, "--data", data, "--output", out, "--steps", "2",
                     "--seq-len", "16", "--micro-batch-size", "2", "--tokenize-workers", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    assert (out / "adapter_model.safetensors").is_file()
