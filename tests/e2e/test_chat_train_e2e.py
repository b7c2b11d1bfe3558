"""A chat fine-tune end to end on embedded Ray: conversations rendered with the model's template,
packed by documents, validated during training; the held-out assistant-token loss drops, and the
validation loss the run reports is `appliance eval`'s on the same data with the adapter."""

from __future__ import annotations

import io
import json
import random

import pytest
from click.testing import CliRunner

from appliance.adapter.evaluate import evaluate
from appliance.cli.main import main
from appliance.run.progress import Progress
from tests.helpers_model import make_model, tiny_train_config
from tests.helpers_tokenizer import WORDS, make_chat_tokenizer

pytestmark = pytest.mark.integration


def conversations(n: int, seed: int) -> list[dict]:
    """Random one-to-three-word user turns, each answered with the same sentence (what there is to
    learn), sometimes after a system prompt, sometimes over two turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "the sun"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2)):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": "big red dog ran far away"},
            ]
        out.append({"messages": messages})
    return out


def test_chat_fine_tune_drops_held_out_assistant_loss(ray_local, tmp_path):
    from appliance.run.driver import train

    # weights 5x HF's default scale: at 0.02 the frozen random LM head caps every logit near 1.3,
    # and no adapter could bring the loss under ~2.9 (ln 64 = 4.2)
    model_dir = make_model(tmp_path / "model", "llama-mha", initializer_range=0.1)
    make_chat_tokenizer(model_dir)
    data, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(160, seed=1)))
    held_out.write_text("".join(json.dumps(c) + "\n" for c in conversations(24, seed=2)))
    cfg = tiny_train_config(
        model_dir, data, tmp_path / "out", steps=30, seq_len=64, eval_data=held_out, eval_every=15
    )
    out = io.StringIO()
    summary = train(cfg, Progress("json", stream=out))

    log = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in log if "eval_loss" in r] == [15, 30]
    before = evaluate(model_dir, held_out, seq_len=64)["loss"]
    after = evaluate(model_dir, held_out, seq_len=64, adapter_dir=tmp_path / "out")["loss"]
    assert after < 0.3 * before, (before, after)
    # the run's validation loss is appliance eval's on the same data, with the same targets
    assert abs(summary["eval_loss"] - after) / after < 1e-4
    # which `appliance eval --adapter OUT` alone computes: the run's model, --seq-len and
    # validation set (--eval-data) come with its adapter
    result = CliRunner().invoke(main, ["eval", "--adapter", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] == pytest.approx(after, rel=1e-6)
    assert 0 < summary["target_share"] < 1  # prompts and user turns are no targets
