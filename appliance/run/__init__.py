"""`appliance train`, from the command line's config to a trained adapter.

driver.py       the run's steps: check the inputs, decide fresh / resume, start Ray and the
                actors, hand over to the loop (train)
loop.py         the step loop: feed rows, step every trainer, evaluate, checkpoint, recover
state.py        what the loop carries between steps (inputs, RunState)
feed.py         tokenizer workers' rows scheduled to the trainers
record.py       run.json: the run's identity and status, what resume compares against
output_lock.py  one run per --output (a local lock file, or a lease on S3)
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
