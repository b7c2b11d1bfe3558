"""`appliance train --finetuning-type full` end to end (CPU, fp32, embedded Ray): a run hit by
every interruption the issue lists ends with the same per-step losses and the same weights as the
run left alone, and its output is a model that transformers loads as it is and that scores the
held-out loss `appliance eval` gives it.

One test, four `appliance train` processes (the patterns are tests/e2e/test_faults.py's): the
reference, run beside one child whose trainer is SIGKILLed (recreated in the run) and which is
then stopped with Ctrl-C (SIGINT: a checkpoint, exit 130); its `--resume`, whose driver is
SIGKILLed; and the `--resume` that ends it.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from appliance.adapter.evaluate import evaluate, read_documents
from appliance.storage.checkpoints import load_latest_checkpoint
from tests.e2e.test_faults import Proc, args, build_inputs, run_record
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

STEPS, EVERY = 9, 3
FULL = ["--finetuning-type", "full", "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
FULL += ["--lr", "1e-3"]


class Child(Proc):
    """A child whose stdout may hold a line of Ray's besides the JSON records (the raylet says
    so when it sees the killed trainer's worker die)."""

    def wait_for_step(self, n: int) -> None:
        for line in self.p.stdout:
            record = json.loads(line) if line.startswith("{") else {}
            if "step" in record:
                self.steps.append(record)
                if record["step"] >= n:
                    return
        raise AssertionError(f"run ended before step {n}: {self.p.stderr.read()[-2000:]}")


def finish(proc: Proc, rc: int = 0) -> str:
    """Wait for the child; its stderr (asserting it exited with `rc`)."""
    got, _, err = proc.finish()
    assert got == rc, err[-3000:]
    return err


def test_full_finetune_survives_trainer_and_driver_kills_and_ctrl_c_exactly(tmp_path):
    inputs = build_inputs(tmp_path)
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    reference = Proc(args(inputs, ref_out, *FULL))  # beside the first child: the CPUs are shared

    # the trainer SIGKILLed one step past the first checkpoint: the run recreates it, which
    # restores the checkpoint's weights into the store's home and repeats step 4; then Ctrl-C
    child = Child(args(inputs, out, *FULL))
    child.wait_for_step(EVERY + 1)
    child.descendant("ray::FullTrainer").send_signal(signal.SIGKILL)
    child.wait_for_step(EVERY + 2)
    child.p.send_signal(signal.SIGINT)
    err = finish(child, 130)
    assert "trainer failed" in err and "Traceback" not in err
    stopped = load_latest_checkpoint(str(out)).step
    assert EVERY + 2 <= stopped < 2 * EVERY + 1
    assert f"interrupted by SIGINT after step {stopped}/{STEPS}" in err
    assert f"train --output {out} --resume" in err
    assert run_record(out)["status"] == "interrupted"
    assert not (out / "config.json").exists()  # the model is published at the end only
    assert child.steps[-1]["restarts"] == 1

    # resumed, then the driver SIGKILLed one step past the checkpoint of step 6
    resumed = Proc(args(inputs, out, *FULL, "--resume"))
    resumed.wait_for_step(2 * EVERY + 1)
    resumed.kill_all()
    assert load_latest_checkpoint(str(out)).step == 2 * EVERY
    assert run_record(out)["status"] == "running"
    finish(Proc(args(inputs, out, *FULL, "--resume")))
    finish(reference)

    # every step's loss and every weight: the uninterrupted run's
    got, ref = run_record(out), run_record(ref_out)
    assert got["status"] == "complete" and got["config"]["finetuning_type"] == "full"
    assert len(got["losses"]) == STEPS and got["weight_store_loads"] == 1
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, atol=0)
    assert got["losses"][-1] < got["losses"][0]
    weights, ref_weights = (
        load_file(out / "model.safetensors"),
        load_file(ref_out / "model.safetensors"),
    )
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], ref_weights[k]), k
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "every weight" in card

    # the output as transformers loads it, on held-out documents, equals `appliance eval` of it
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(20, seed=7)))
    ours_eval = evaluate(out, held_out, 32)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    total, n = 0.0, 0
    for ids, mask in read_documents(held_out, tokenizer, model.config.eos_token_id, 32):
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].float()
        targets = torch.from_numpy(ids[1:]).masked_fill(~torch.from_numpy(mask[1:]), -100)
        total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
        n += int(mask[1:].sum())
    assert n == ours_eval["tokens"]
    assert abs(total / n - ours_eval["loss"]) <= 1e-6 * ours_eval["loss"]
    # and the model moved from the base: it is the trained one, not a copy
    base = AutoModelForCausalLM.from_pretrained(inputs[0], dtype=torch.float32)
    assert not torch.equal(base.lm_head.weight, model.lm_head.weight)
