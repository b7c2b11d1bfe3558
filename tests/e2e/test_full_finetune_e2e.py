"""`appliance train --finetuning-type full` end to end (CPU, fp32, embedded Ray): a driver killed
outright and resumed repeats the steps it had made after its checkpoint exactly, and the output is a model that
transformers loads as it is and that scores the held-out loss `appliance eval` gives it.

One test (two runs of a tiny model): the patterns are tests/e2e/test_faults.py's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from appliance.adapter.evaluate import evaluate, read_documents
from appliance.storage.checkpoints import load_latest_checkpoint
from tests.e2e.test_faults import Proc, args, build_inputs, run_record, run_to_end
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

FULL = ["--finetuning-type", "full", "--steps", "8", "--checkpoint-every", "4", "--lr", "1e-3"]


def test_full_finetune_resumes_exactly_after_a_driver_kill_and_loads_with_transformers(tmp_path):
    inputs = build_inputs(tmp_path)
    out = tmp_path / "out"
    proc = Proc(args(inputs, out, *FULL))
    proc.wait_for_step(6)  # two steps past the first checkpoint (step 4)
    proc.kill_all()
    assert load_latest_checkpoint(str(out)).step == 4
    assert run_record(out)["status"] == "running"
    assert run_to_end(args(inputs, out, *FULL, "--resume"))["steps"] == 8

    # steps 5 and 6 again: the weights (step 5's loss) and the AdamW moments and masters (step
    # 6's, after an update from them) came back exactly
    got = run_record(out)
    assert got["status"] == "complete" and got["config"]["finetuning_type"] == "full"
    killed = {r["step"]: r["loss"] for r in proc.steps}
    np.testing.assert_allclose(got["losses"][4:6], [killed[5], killed[6]], rtol=1e-6, atol=0)
    assert got["losses"][-1] < got["losses"][0]
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
