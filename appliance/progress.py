"""What the user sees while training: a live rich display, one JSON object per step, or plain
lines. The run calls `start` and `step` (with the trainer's stats); the driver calls `stop` when
the run ends, however it ends (so an error line never lands inside a live table), then `finish`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(
        self,
        log_format: str = "rich",
        stream=None,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`stream` takes the step lines / JSON records (stdout); `console` the rich output
        (default: on `stream`, or stderr in JSON mode); `clock` gives the seconds for rates."""
        self.format = log_format
        self.stream = stream or sys.stdout
        self.console = console or Console(file=sys.stderr if log_format == "json" else self.stream)
        self.clock = clock
        self.live: Live | None = None
        self.restarts = 0
        self._tokens = 0
        self._seconds = 0.0
        self._wait = 0.0
        self._eval_loss: float | None = None  # the last validation loss (--eval-*)

    def note(self, text: str) -> None:
        """A one-line message (kept off stdout in JSON mode, which is for step records only)."""
        if self.format == "json":
            print(text, file=sys.stderr, flush=True)
        else:
            self.console.print(text)

    def start(self, total_steps: int, first_step: int = 0) -> None:
        self.total, self.first = total_steps, first_step
        self.t0 = self.clock()
        if self.format == "rich":
            self.live = Live(
                self._table(first_step, None),
                console=self.console,
                refresh_per_second=4,
                transient=False,
            )
            self.live.start()

    def step(self, step: int, stats: dict) -> None:
        self._tokens += stats["tokens"]
        self._seconds += stats["step_seconds"]
        self._wait += stats["phase_seconds"].get("data_wait", 0.0)
        if stats.get("eval_loss") is not None:
            self._eval_loss = stats["eval_loss"]
        if self.format == "json":
            record = {
                "step": step,
                "loss": stats["loss"],
                "tokens": stats["tokens"],
                "lr": stats["lr"],
                "step_seconds": stats["step_seconds"],
                "target_tokens": stats["target_tokens"],
                "grad_norm": stats["grad_norm"],
                "phase_seconds": stats["phase_seconds"],
                "restarts": self.restarts,
            }
            if "packing_efficiency" in stats:
                record["packing_efficiency"] = stats["packing_efficiency"]
            if stats.get("eval_loss") is not None:  # only on the steps that validated
                record["eval_loss"] = stats["eval_loss"]
            print(json.dumps(record), file=self.stream, flush=True)
        elif self.format == "plain":
            validated = stats.get("eval_loss") is not None
            if step == self.total or step % 10 == 0 or step == self.first + 1 or validated:
                print(self._line(step, stats), file=self.stream, flush=True)
        elif self.live is not None:
            self.live.update(self._table(step, stats))

    def _rates(self, step: int) -> tuple[float, float, float]:
        elapsed = self.clock() - self.t0
        tps = self._tokens / elapsed if elapsed > 0 else 0.0
        done = step - self.first
        eta = elapsed / done * (self.total - step) if done else 0.0
        wait = self._wait / self._seconds if self._seconds else 0.0
        return tps, eta, wait

    def _line(self, step: int, stats: dict) -> str:
        tps, eta, wait = self._rates(step)
        line = (
            f"step {step}/{self.total}  loss {stats['loss']:.4f}  tok/s {tps:,.0f}  "
            f"data-wait {wait:.0%}  eta {_fmt_seconds(eta)}  restarts {self.restarts}"
        )
        if self._eval_loss is not None:
            line += f"  eval-loss {self._eval_loss:.4f}"
        return line

    def _table(self, step: int, stats: dict | None) -> Table:
        table = Table(title="appliance train", show_header=True)
        columns = ["step", "loss", "tokens/s", "data wait", "ETA", "restarts"]
        if stats is None:
            row = [f"{step}/{self.total}", "-", "-", "-", "-", str(self.restarts)]
        else:
            tps, eta, wait = self._rates(step)
            row = [
                f"{step}/{self.total}",
                f"{stats['loss']:.4f}",
                f"{tps:,.0f}",
                f"{wait:.0%}",
                _fmt_seconds(eta),
                str(self.restarts),
            ]
        if self._eval_loss is not None:  # a column once the run has validated (--eval-*)
            columns.append("eval loss")
            row.append(f"{self._eval_loss:.4f}")
        for col in columns:
            table.add_column(col, justify="right")
        table.add_row(*row)
        return table

    def stop(self) -> None:
        """Stop the live table (if one is showing): safe to call more than once."""
        if self.live is not None:
            self.live.stop()  # also gives back stdout/stderr, which a live table redirects
            self.live = None
            if not self.console.is_terminal:
                self.console.line()  # a terminal ends the live table's line itself; a pipe not

    def finish(self, summary: dict) -> None:
        self.stop()
        if self.format == "json":
            print(json.dumps({"summary": summary}), file=self.stream, flush=True)
            return
        self.console.print(
            "[bold]done[/bold]: "
            + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
            )
        )
