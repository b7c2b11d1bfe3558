"""OUTPUT/history.jsonl (appliance/run/history_log.py): a line per step and per validation,
going back with the run to a checkpoint without losing or repeating a step."""

from __future__ import annotations

import json
import math

from appliance.run.history_log import HistoryLog, eval_record, read_history, step_record


def _stats(loss: float) -> dict:
    return {"loss": loss, "lr": 1e-3, "grad_norm": math.inf, "tokens": 64, "target_tokens": 60,
            "step_seconds": 0.5, "phase_seconds": {"data_wait": 0.1}, "host_rss": 1000}  # fmt: skip


def test_lines_carry_hf_names_and_strict_json(tmp_path):
    log = HistoryLog(str(tmp_path))
    log.rewind(0, [], [])
    log.append([step_record(1, 0.5, _stats(2.0)), eval_record(1, 0.5, 1.5)])
    log.flush()
    log.close()
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    first = json.loads(lines[0])  # strict JSON: an overflowed step's norm is null
    assert first == {"step": 1, "epoch": 0.5, "loss": 2.0, "learning_rate": 1e-3,
                     "grad_norm": None, "tokens": 64, "target_tokens": 60, "step_seconds": 0.5,
                     "host_memory_bytes": 1000, "tokens_per_second": 128.0,
                     "data_wait_seconds": 0.1}  # fmt: skip
    assert json.loads(lines[1]) == {"step": 1, "epoch": 0.5, "eval_loss": 1.5}


def test_rewind_drops_later_steps_and_puts_back_missing_ones(tmp_path):
    path = tmp_path / "history.jsonl"
    kept = [{"step": 2, "loss": 2.5, "learning_rate": 0.1}]
    later = [{"step": 4, "loss": 9.0}, {"step": 4, "eval_loss": 8.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept + later) + '{"step": 5, "lo')
    log = HistoryLog(str(tmp_path))
    note = log.rewind(3, [1.0, 2.5, 3.0], [[1, 0.9]])  # the checkpoint of step 3
    assert note == (
        "history.jsonl: 1 step(s) after step 3 left out (they are trained again); "
        "3 line(s) put back from the checkpoint's losses"
    )
    assert read_history(str(tmp_path)) == [
        {"step": 1, "loss": 1.0, "from_checkpoint": True},
        {"step": 1, "eval_loss": 0.9, "from_checkpoint": True},
        {"step": 2, "loss": 2.5, "learning_rate": 0.1},  # the line as it was written
        {"step": 3, "loss": 3.0, "from_checkpoint": True},
    ]
    log.append([step_record(4, None, _stats(4.0))])  # appended after the rewound lines
    log.close()
    assert [r["step"] for r in read_history(str(tmp_path))] == [1, 1, 2, 3, 4]
    assert HistoryLog(str(tmp_path)).rewind(4, [1.0, 2.5, 3.0, 4.0], [[1, 0.9]]) is None
