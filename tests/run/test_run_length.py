"""What a run says about its length and data before the first step (issue 45, item 3):
--warmup-ratio as Hugging Face computes it, the warnings, the data summary."""

from __future__ import annotations

from types import SimpleNamespace

from appliance.config import build_config
from appliance.engine.schedule import lr_at, warmup_for
from appliance.run.feed import data_summary, length_notes


def cfg(**flags):
    return build_config({}, {"model": "m", "data": "d", "output": "o", **flags})


def test_warmup_ratio_is_hf_s_rule_and_the_schedule_peaks_at_its_end():
    assert warmup_for(40, 10, 0.1) == 4 and warmup_for(41, 10, 0.1) == 5  # ceil
    assert warmup_for(40, 10, None) == 10
    rates = [lr_at(s, lr=1e-3, warmup_steps=4, total_steps=40) for s in range(6)]
    assert rates[2] < rates[3] == max(rates) == 1e-3 and rates[5] < rates[3]  # then decays


def test_a_warmup_as_long_as_the_run_and_small_data_repeated_are_warned():
    short = cfg(steps="5")  # --warmup-steps 10 by default
    notes = length_notes(short, 5, 2.5, 4)
    assert (
        notes[0]
        == "run: 5 steps of 16 rows of 256 tokens, 2 epoch(s) of 2.5 steps; warm-up 10 steps"
    )
    assert notes[1].startswith("warning: the warm-up (10 steps) is as long as the run (5 steps)")
    many = length_notes(cfg(steps="40"), 40, 2, 4)
    assert many[1].startswith("warning: the run passes over its data 20 times (2 steps an epoch)")
    assert len(length_notes(cfg(steps="40"), 40, 2, 4, demo=True)) == 1  # the demo means to
    big = length_notes(cfg(steps="40", warmup_ratio="0.1"), 40, None, 4)
    assert big == [
        "run: 40 steps of 16 rows of 256 tokens (the data is over 64 MiB: not counted, no "
        "epochs); warm-up 10 steps (--warmup-ratio 0.1)"
    ]  # (the run resolves --warmup-steps from the ratio before it says so: loop.py)


def test_the_data_summary_counts_held_out_and_long_documents():
    figures = [
        {"documents": 40, "tokens": 900, "long": 2, "long_left_out": 30, "read": 41, "total": 90},
        {"documents": 38, "tokens": 800, "long": 1, "long_left_out": 12, "read": 39, "total": 90},
    ]
    inp = SimpleNamespace(cfg=cfg(eval_split="0.1", long_documents="truncate", seq_len="64"))
    assert data_summary(figures, inp, 4) == [
        "data: 78 documents, 1,700 tokens read; 10 held out for validation (--eval-split 0.1)",
        "warning: 3 of the 78 documents are longer than --seq-len 64: truncated to it (42 tokens "
        "left out) (--long-documents truncate; split | truncate | drop)",
    ]
