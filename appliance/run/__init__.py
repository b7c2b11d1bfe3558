"""`appliance train`, from the command line's config to a trained adapter.

driver.py       the run's steps: check the inputs, start Ray and the actors, hand over to the
                loop, record how it ended (train)
inputs.py       every input checked before anything heavy starts (resolve_inputs)
resume.py       what --output holds decides: start, resume or replace (decide_output)
loop.py         the step loop: feed rows, step every trainer, evaluate, checkpoint, recover
launch.py       the run's actors: how many, where, with what settings (for loop.py)
state.py        what the loop carries between steps (inputs, RunState)
feed.py         tokenizer workers' rows scheduled to the trainers
record.py       run.json: the run's identity and status, what resume compares against
progress.py     what the user sees: the live table, plain lines or JSON
failures.py     which failures are retried and which end the run
demo.py         the built-in demo (a tiny model, tokenizer and corpus) for `make train`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.config import TrainConfig
    from appliance.run.progress import Progress

__all__ = ["train"]


def train(cfg: TrainConfig, progress: Progress | None = None) -> dict:
    """run/driver.train, imported when called (it brings Ray's side of the appliance with it)."""
    from appliance.run.driver import train as run

    return run(cfg, progress)
