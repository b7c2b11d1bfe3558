"""Validation during training: the --eval-* flags, the held-out split (deterministic, never trained
on), and where the validation loss shows (JSON log, plain line, live table)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from appliance.actors.tokenize_worker import TokenizeWorker
from appliance.adapter.evaluate import read_documents
from appliance.config import build_config
from appliance.data.records import DataError, Holdout, check_has_targets, load_tokenizer
from appliance.errors import ConfigError
from appliance.run.progress import Progress
from tests.helpers_tokenizer import make_tokenizer, sentences


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"eval_split": "1.5"}, "--eval-split must be in (0, 1) (got 1.5)"),
        ({"eval_split": "0.1", "eval_data": "x"}, "--eval-data and --eval-split are exclusive"),
        ({"eval_every": "10"}, "--eval-every needs --eval-data PATH or --eval-split FRACTION"),
        ({"eval_every": "0", "eval_split": "0.1"}, "--eval-every must be ≥ 1 (got 0)"),
        ({"packing": "tight"}, "--packing must be one of documents | stream (got 'tight')"),
    ],
)
def test_bad_validation_and_packing_flags_are_named(flags, message):
    with pytest.raises(ConfigError) as e:
        build_config({}, {"model": "m", "data": "d", "output": "o", **flags})
    assert message in str(e.value)


def test_holdout_is_deterministic_disjoint_and_never_trained_on(tmp_path):
    tok, _, eos, pad = make_tokenizer(tmp_path / "tok")
    texts = sentences(200, seed=3, min_words=2)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    trained = []
    for w in range(2):
        worker = TokenizeWorker(str(data), tok, w, 2, 64, 2, eos, pad, holdout=Holdout(0.2, seed=7))
        worker.next_batch()
        while worker.next_batch() is not None:
            pass
        trained.append(worker.documents_total)
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(tok)
    held = read_documents(data, t, eos, 64, holdout=Holdout(0.2, seed=7, held_out=True))
    assert 20 < len(held) < 60  # about 20% of 200
    assert sum(trained) + len(held) == len(texts)  # disjoint, and together everything
    again = read_documents(data, t, eos, 64, holdout=Holdout(0.2, seed=7, held_out=True))
    assert [d[0].tolist() for d in again] == [d[0].tolist() for d in held]
    other = read_documents(data, t, eos, 64, holdout=Holdout(0.2, seed=8, held_out=True))
    assert [d[0].tolist() for d in other] != [d[0].tolist() for d in held]  # --seed picks them


def test_the_held_out_documents_stay_those_of_the_runs_files_when_one_joins_mid_run(tmp_path):
    """--eval-split holds documents out by their index over the data files; the validation set,
    built at the first eval, counts them over the files the run started with, as the workers do:
    a shard written into the directory since would otherwise move trained documents into it."""
    from appliance.adapter.evaluate import validation_batches
    from appliance.data.listing import file_names
    from appliance.run.state import Inputs

    tok, _, eos, pad = make_tokenizer(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    texts = sentences(120, seed=4, min_words=2)
    (data / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    names = file_names(data, [data / "b.jsonl"])
    cfg = build_config(
        {},
        {
            "model": str(tmp_path / "model"),
            "data": str(data),
            "output": str(tmp_path / "out"),
            "eval_split": "0.25",
            "seq_len": "64",
            "micro_batch_size": "2",
        },
    )
    inp = Inputs(cfg, tmp_path / "model", data, eos, pad, "cpu", "f32", data_files=names)
    before = validation_batches(cfg, inp)
    new = sentences(30, seed=5, min_words=2)
    (data / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in new))
    after = validation_batches(cfg, inp)
    assert [b.input_ids.tolist() for b in after] == [b.input_ids.tolist() for b in before]
    now = validation_batches(cfg, Inputs(cfg, tmp_path / "model", data, eos, pad, "cpu", "f32"))
    assert [b.input_ids.tolist() for b in now] != [b.input_ids.tolist() for b in before]


def test_a_validation_sets_problems_name_the_set(tmp_path):
    """A bad record of --eval-data, or one with nothing to score, is named as the validation
    set's (the run builds it before its first step)."""
    from appliance.adapter.evaluate import validation_batches
    from appliance.run.state import Inputs

    tok, _, eos, pad = make_tokenizer(tmp_path / "model")
    data, held = tmp_path / "d.jsonl", tmp_path / "v.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    held.write_text(json.dumps({"text": "the dog"}) + "\n" + json.dumps({"txt": "a"}) + "\n")
    flags = {"model": str(tmp_path / "model"), "data": str(data), "output": str(tmp_path / "o")}
    cfg = build_config({}, {**flags, "eval_data": str(held)})
    inp = Inputs(cfg, tmp_path / "model", data, eos, pad, "cpu", "f32")
    with pytest.raises(DataError, match=rf'^--eval-data {held}: {held}:2: record has no "text"'):
        validation_batches(cfg, inp)
    held.write_text(json.dumps({"text": ""}) + "\n")  # an empty text scores nothing
    with pytest.raises(DataError) as e:
        validation_batches(cfg, inp)
    assert str(e.value) == (
        f"--eval-data {held}: no document has a target token; nothing to validate on "
        "(check the data)"
    )


def test_a_dataset_without_any_target_token_is_refused(tmp_path):
    from tests.helpers_tokenizer import make_chat_tokenizer

    make_chat_tokenizer(tmp_path)
    from appliance.data.chat import ChatTemplate

    # a template that drops the assistant's turns: every conversation has nothing to learn
    silent = ChatTemplate(
        "silent.jinja",
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }} "
        "{% endif %}{% endfor %}",
    )
    data = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]
    data.write_text(json.dumps({"messages": msgs}) + "\n")
    worker = TokenizeWorker(
        str(data), str(tmp_path / "tokenizer.json"), 0, 1, 8, 1, 2, 0, chat_template=silent
    )
    with pytest.raises(DataError, match="has a target token \\(nothing to learn\\)"):
        worker.next_batch()
    # ... and the driver's check refuses it before any actor starts
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="c.jsonl: no record has a target token"):
        check_has_targets(data, tok, 2, silent)
    data.write_text(
        "".join(json.dumps({"messages": msgs}) + "\n" for _ in range(70))
        + json.dumps({"text": "the cat"})
        + "\n"
    )
    check_has_targets(data, tok, 2, silent)  # the text record (in the second chunk) has targets


def stats(loss: float, eval_loss: float | None = None) -> dict:
    s = {
        "loss": loss,
        "tokens": 64,
        "lr": 1e-3,
        "step_seconds": 0.1,
        "target_tokens": 50,
        "grad_norm": 1.0,
        "phase_seconds": {},
        "target_share": 0.78,
    }
    if eval_loss is not None:
        s["eval_loss"] = eval_loss
    return s


def test_eval_loss_in_the_json_log_the_plain_line_and_the_live_table():
    out = io.StringIO()
    p = Progress("json", stream=out)
    p.start(3)
    p.step(1, stats(3.0))
    p.step(2, stats(2.5, eval_loss=2.75))
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert ["eval_loss" in r for r in records] == [False, True]
    assert records[1]["eval_loss"] == 2.75 and records[1]["target_share"] == 0.78

    out = io.StringIO()
    p = Progress("plain", stream=out)
    p.start(30)
    p.step(5, stats(2.5, eval_loss=2.75))  # a validation step prints its line
    assert "eval-loss 2.7500" in out.getvalue()

    console = Console(file=io.StringIO(), width=200)
    p = Progress("rich", console=console)
    p.start(3)
    p.step(1, stats(3.0, eval_loss=2.9))
    table = p._table(1, stats(3.0))
    assert [c.header for c in table.columns][-1] == "eval loss"
    p.stop()
