"""What the user sees while training: the live table, the JSON step records, and a failing run
that stops its live table before the error line is printed."""

from __future__ import annotations

import io
import json
import math
import re
import sys
import time

import pytest
from rich.console import Console
from rich.file_proxy import FileProxy

from appliance.data.records import DataError
from appliance.engine.schedule import lr_at
from appliance.run import feed
from appliance.run.driver import train
from appliance.run.progress import Progress
from tests.helpers_model import make_model, tiny_train_config
from tests.helpers_tokenizer import sentences


def stats(loss: float, tokens: int, step_seconds: float, data_wait: float) -> dict:
    """The fields of a trainer step's stats that the display reads."""
    return {
        "loss": loss,
        "tokens": tokens,
        "lr": 1e-3,
        "step_seconds": step_seconds,
        "target_tokens": tokens,
        "grad_norm": 1.0,
        "phase_seconds": {"data_wait": data_wait, "forward": step_seconds - data_wait},
    }


def table_rows(console: Console) -> list[list[str]]:
    """The cells of every table row (header included) that `console` printed."""
    rows = [re.split("[│┃]", line) for line in console.export_text(clear=False).splitlines()]
    return [[c.strip() for c in row[1:-1]] for row in rows if len(row) > 2]


def test_the_live_table_shows_step_loss_tokens_per_second_data_wait_eta_and_restarts():
    console = Console(record=True, file=io.StringIO(), width=120, force_terminal=False)
    now = [100.0]
    progress = Progress("rich", console=console, clock=lambda: now[0])
    progress.start(total_steps=10)
    progress.restarts = 2  # the run sets it when it recreates an actor
    for step, loss in ((1, 3.0), (2, 2.75), (3, 2.5), (4, 2.25)):
        now[0] += 10 / 3  # 10/3 s a step
        progress.step(step, stats(loss, tokens=1000, step_seconds=2.0, data_wait=0.5))
    progress.stop()
    assert progress.live is None
    header, row = table_rows(console)[-2:]
    assert header == ["step", "loss", "tokens/s", "data wait", "ETA", "restarts"]
    # 4000 tokens in 40/3 s; 25% of step time waiting for data; the ETA from the 3 steps timed
    # after the first (its warm-up would skew it): 6 steps left at 10/3 s each
    assert row == ["4/10", "2.2500", "300", "25%", "0:00:20", "2"]


def test_the_epoch_is_on_each_line_table_row_and_json_record_when_the_data_was_counted():
    console = Console(record=True, file=io.StringIO(), width=120, force_terminal=False)
    rich = Progress("rich", console=console)
    rich.start(total_steps=8)
    rich.step(3, {**stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.0), "epoch": 0.75})
    rich.stop()
    header, row = table_rows(console)[-2:]
    assert header[:3] == ["step", "epoch", "loss"] and row[:3] == ["3/8", "0.75", "2.0000"]
    stream = io.StringIO()
    plain = Progress("plain", stream=stream, heartbeat=False)
    plain.start(total_steps=8)
    plain.step(1, {**stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.0), "epoch": 0.25})
    plain.step(8, {**stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.0), "epoch": None})
    first, second = stream.getvalue().splitlines()
    assert first.startswith("step 1/8  loss 2.0000  tok/s ") and first.endswith("  epoch 0.25")
    assert second.endswith("restarts 0")  # no epoch where the data was not counted
    out = io.StringIO()
    as_json = Progress("json", stream=out)
    as_json.step(1, {**stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.0), "epoch": 0.25})
    assert json.loads(out.getvalue())["epoch"] == 0.25


def test_off_a_terminal_auto_prints_plain_lines_every_10_steps_or_10_seconds():
    stream, now = io.StringIO(), [0.0]
    progress = Progress("auto", stream=stream, clock=lambda: now[0], heartbeat=False)
    assert progress.format == "plain"  # a StringIO is no terminal
    progress.start(total_steps=25)
    for step in range(1, 26):
        now[0] += 12.0 if step == 14 else 1.0  # one slow step: a line at least every 10 s
        progress.step(step, stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.1))
    progress.finish({"steps": 25, "final_loss": 2.0, "output": "x" * 200})
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"step (\d+)/25 ", x).group(1)) for x in lines[:-1]] == [1, 10, 14, 20, 25]
    assert "eta -" in lines[0]  # no ETA before 3 steps after the first were timed
    # the ETA from the steps after the first: 24 s for 13 steps, 11 steps left
    assert re.search(r"loss 2\.0000  tok/s [\d,]+  data-wait 10%  eta 0:00:20", lines[2])
    assert lines[-1].startswith("done: steps 25, final_loss 2, output xxx")  # one line, unwrapped


def test_a_step_longer_than_10_seconds_gets_a_line_while_it_runs():
    stream, now = io.StringIO(), [0.0]
    progress = Progress("plain", stream=stream, clock=lambda: now[0])
    progress.start(total_steps=5)
    progress.step(1, stats(2.0, tokens=100, step_seconds=1.0, data_wait=0.1))
    now[0] += 11.0  # step 2 has run for 11 s: the heartbeat (a thread, once a second) says so
    deadline = time.monotonic() + 30
    while "running" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    progress.stop()
    assert stream.getvalue().splitlines()[-1] == "step 2/5 running for 0:00:11"


def test_float16_steps_show_their_loss_scale_and_the_skipped_steps():
    """A float16 run's stats carry the loss scale, whether the step was skipped (its gradient
    overflowed) and the run's skipped steps so far; bf16 and fp32 runs show none of it."""
    fp16 = [
        {**stats(2.0, 100, 1.0, 0.1), "loss_scale": 65536.0, "skipped_step": True,
         "skipped_steps": 1, "grad_norm": float("inf")},
        {**stats(2.0, 100, 1.0, 0.1), "loss_scale": 32768.0, "skipped_step": False,
         "skipped_steps": 1},
    ]  # fmt: skip
    stream = io.StringIO()
    progress = Progress("json", stream=stream)
    progress.start(total_steps=3)
    for step, st in enumerate([*fp16, stats(2.0, 100, 1.0, 0.1)], start=1):
        progress.step(step, st)
    # strict JSON: the skipped step's infinite norm is null, not `Infinity`
    records = [
        json.loads(line, parse_constant=pytest.fail) for line in stream.getvalue().splitlines()
    ]
    assert [r["grad_norm"] is None for r in records] == [True, False, False]
    assert [(r["loss_scale"], r["skipped_step"], r["skipped_steps"]) for r in records[:2]] == [
        (65536.0, True, 1),
        (32768.0, False, 1),
    ]
    assert "loss_scale" not in records[2]  # a step without a scaler

    stream, now = io.StringIO(), [0.0]
    progress = Progress("plain", stream=stream, clock=lambda: now[0], heartbeat=False)
    progress.start(total_steps=2)
    for step, st in enumerate(fp16, start=1):
        progress.step(step, st)
    lines = stream.getvalue().splitlines()
    assert [line.endswith("  skipped-steps 1") for line in lines] == [True, True]
    progress = Progress("plain", stream=io.StringIO(), heartbeat=False)
    progress.start(total_steps=1)
    assert "skipped" not in progress._line(1, stats(2.0, 100, 1.0, 0.1))

    console = Console(record=True, file=io.StringIO(), width=120, force_terminal=False)
    progress = Progress("rich", console=console)
    progress.start(total_steps=2)
    progress.step(1, fp16[0])
    progress.stop()
    header, row = table_rows(console)[-2:]
    assert header[-1] == "skipped steps" and row[-1] == "1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "model", "llama-mha")


def tiny_run(model_dir, data, output, **kw):
    """Five steps, one tokenizer worker, two warm-up steps: the schedule has both shapes."""
    settings = dict(
        tokenize_workers=1, warmup_steps=2, min_lr_ratio=0.1, steps=5, log_format="rich"
    )
    return tiny_train_config(model_dir, data, output, **{**settings, **kw})


@pytest.mark.integration
def test_json_log_has_one_record_per_step_with_the_scheduled_lr(ray_local, model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(40)))
    cfg = tiny_run(model_dir, data, tmp_path / "out", log_format="json")
    stream = io.StringIO()
    summary = train(cfg, Progress("json", stream=stream))
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    steps, last = records[:-1], records[-1]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["tokens"] > 0 and r["step_seconds"] > 0
        expected = lr_at(r["step"] - 1, lr=1e-2, warmup_steps=2, total_steps=5, min_lr_ratio=0.1)
        assert r["lr"] == pytest.approx(expected, rel=1e-12)
    assert last == {"summary": json.loads(json.dumps(summary))}
    assert last["summary"]["final_loss"] == steps[-1]["loss"]


@pytest.mark.integration
def test_a_failing_run_stops_the_live_table_before_the_error_is_printed(
    ray_local, model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(feed, "COUNT_DATA_BYTES", 0)  # no count before the run: it fails mid-run
    data = tmp_path / "data.jsonl"
    # broken far enough in that the driver's check before training (it reads records until one
    # has a target) passes and a tokenizer worker meets it mid-run
    lines = [json.dumps({"text": s}) for s in sentences(200)]
    lines[149] = '{"text": broken'
    data.write_text("\n".join(lines) + "\n")
    # a terminal console: a live table there takes over sys.stdout and sys.stderr while it runs
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    progress = Progress("rich", console=console)
    try:
        with pytest.raises(DataError, match=f"{data}:150: malformed JSON"):
            train(tiny_run(model_dir, data, tmp_path / "out", steps=200), progress)
        assert progress.live is None
        # stdout and stderr are the process's again: the CLI's error line goes to the terminal
        # after the table, not into the live region
        assert not isinstance(sys.stdout, FileProxy) and not isinstance(sys.stderr, FileProxy)
        assert "step" in console.file.getvalue()  # the table was shown before it failed
    finally:
        if progress.live is not None:  # without the fix: leave pytest's streams usable
            progress.live.stop()
