"""What the user sees while training: a live rich display, one JSON object per step, or plain
lines. The run calls `start` and `step` (with the trainer's stats); the driver calls `stop` when
the run ends, however it ends (so an error line never lands inside a live table), then `finish`.

`auto` (the default) is the live display on a terminal and plain lines anywhere else (`docker
logs`, `kubectl logs`, `nohup`, `| tee`): a line at the first step, then every PLAIN_EVERY_STEPS
steps or PLAIN_EVERY_SECONDS seconds, whichever comes first, and at the last step."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

PLAIN_EVERY_STEPS = 10
PLAIN_EVERY_SECONDS = 10.0
ETA_AFTER_STEPS = 3  # steps measured (after the first, which warms up) before an ETA is shown


def resolve_format(log_format: str, stream) -> str:
    """`auto` → `rich` when `stream` is a terminal, `plain` otherwise; others as given."""
    if log_format != "auto":
        return log_format
    isatty = getattr(stream, "isatty", None)
    return "rich" if isatty is not None and isatty() else "plain"


def _fmt_seconds(s: float) -> str:
    s = round(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _fmt_eta(s: float | None) -> str:
    return "-" if s is None else _fmt_seconds(s)


class Progress:
    def __init__(
        self,
        log_format: str = "auto",
        stream=None,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
        heartbeat: bool = True,
    ):
        """`stream` takes the step lines / JSON records (stdout); `console` the rich output
        (default: on `stream`, or stderr in JSON mode); `clock` gives the seconds for rates;
        `heartbeat`: in plain mode, a line while a long step runs (a thread)."""
        self.stream = stream or sys.stdout
        self.format = log_format = resolve_format(log_format, self.stream)
        self.console = console or Console(file=sys.stderr if log_format == "json" else self.stream)
        self.clock = clock
        self.live: Live | None = None
        self.restarts = 0
        self._tokens = 0
        self._seconds = 0.0
        self._wait = 0.0
        self._last_line = 0.0  # clock of the last plain line
        self._first_done: tuple[int, float] | None = None  # (step, clock) of the first step
        self._done = (0, 0.0)  # (step, clock) of the last step finished, for the heartbeat
        self._lock = threading.RLock()  # plain lines come from the run and from the heartbeat
        self._beat = heartbeat
        self._heart: threading.Thread | None = None
        self._stopped = threading.Event()
        self._eval_loss: float | None = None  # the last validation loss (--eval-*)

    def note(self, text: str) -> None:
        """A one-line message (kept off stdout in JSON mode, which is for step records only)."""
        if self.format == "json":
            print(text, file=sys.stderr, flush=True)
        elif self.format == "plain":
            self._emit(text)  # whole, never wrapped at 80 columns
        else:
            self.console.print(text)

    def start(self, total_steps: int, first_step: int = 0) -> None:
        self.total, self.first = total_steps, first_step
        self.t0 = self._last_line = self.clock()
        self._first_done = None
        self._done = (first_step, self.t0)
        if self.format == "plain" and self._beat and self._heart is None:
            self._stopped.clear()
            self._heart = threading.Thread(target=self._heartbeat, daemon=True)
            self._heart.start()
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
        if self._first_done is None:
            self._first_done = (step, self.clock())
        self._done = (step, self.clock())
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
                # a skipped float16 step's norm is inf/nan: null, as strict JSON readers want
                "grad_norm": stats["grad_norm"] if math.isfinite(stats["grad_norm"]) else None,
                "phase_seconds": stats["phase_seconds"],
                "restarts": self.restarts,
            }
            if "target_share" in stats:  # targets / row positions so far (docs/data.md)
                record["target_share"] = stats["target_share"]
            if stats.get("epoch") is not None:
                record["epoch"] = stats["epoch"]
            if stats.get("loss_scale") is not None:  # float16: loss scaling (loss_scale.py)
                record["loss_scale"] = stats["loss_scale"]
                record["skipped_step"] = bool(stats.get("skipped_step"))
                record["skipped_steps"] = stats.get("skipped_steps", 0)
            if stats.get("eval_loss") is not None:  # only on the steps that validated
                record["eval_loss"] = stats["eval_loss"]
            if "optimizer_host_seconds" in stats:  # a full fine-tune: the host's AdamW, d2h
                record["optimizer_host_seconds"] = stats["optimizer_host_seconds"]
                record["d2h_bytes"] = stats["d2h_bytes"]
            print(json.dumps(record), file=self.stream, flush=True)
        elif self.format == "plain":
            validated = stats.get("eval_loss") is not None  # a validation step: always a line
            with self._lock:
                now = self.clock()
                if (
                    step == self.total
                    or step % PLAIN_EVERY_STEPS == 0
                    or step == self.first + 1
                    or validated
                    or now - self._last_line >= PLAIN_EVERY_SECONDS
                ):
                    self._last_line = now
                    self._emit(self._line(step, stats))
        elif self.live is not None:
            self.live.update(self._table(step, stats))

    def _rates(self, step: int) -> tuple[float, float | None, float]:
        """Tokens/s, ETA seconds (None until ETA_AFTER_STEPS steps after the first were timed:
        the first step's warm-up would skew it) and the data-wait fraction."""
        now = self.clock()
        elapsed = now - self.t0
        tps = self._tokens / elapsed if elapsed > 0 else 0.0
        eta = None
        if self._first_done is not None and step - self._first_done[0] >= ETA_AFTER_STEPS:
            per_step = (now - self._first_done[1]) / (step - self._first_done[0])
            eta = per_step * (self.total - step)
        wait = self._wait / self._seconds if self._seconds else 0.0
        return tps, eta, wait

    def _line(self, step: int, stats: dict) -> str:
        tps, eta, wait = self._rates(step)
        epoch = f"  epoch {stats['epoch']:.2f}" if stats.get("epoch") is not None else ""
        line = (
            f"step {step}/{self.total}  loss {stats['loss']:.4f}  tok/s {tps:,.0f}  "
            f"data-wait {wait:.0%}  eta {_fmt_eta(eta)}  restarts {self.restarts}{epoch}"
        )
        if stats.get("skipped_steps"):  # float16 steps that overflowed and did not update
            line += f"  skipped-steps {stats['skipped_steps']}"
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
                _fmt_eta(eta),
                str(self.restarts),
            ]
        if stats is not None and stats.get("epoch") is not None:  # when the data was counted
            columns.insert(1, "epoch")
            row.insert(1, f"{stats['epoch']:.2f}")
        if stats is not None and stats.get("skipped_steps"):  # float16 steps that overflowed
            columns.append("skipped steps")
            row.append(str(stats["skipped_steps"]))
        if self._eval_loss is not None:  # a column once the run has validated (--eval-*)
            columns.append("eval loss")
            row.append(f"{self._eval_loss:.4f}")
        for col in columns:
            table.add_column(col, justify="right")
        table.add_row(*row)
        return table

    def _heartbeat(self) -> None:
        """Plain mode: when a step runs longer than PLAIN_EVERY_SECONDS (a 70B step takes about a
        minute), a line saying which step is running and for how long, so a log never goes
        quiet for more than that."""
        while not self._stopped.wait(1.0):
            with self._lock:
                now = self.clock()
                step, since = self._done
                if now - self._last_line >= PLAIN_EVERY_SECONDS and step < self.total:
                    self._last_line = now
                    self._emit(
                        f"step {step + 1}/{self.total} running for {_fmt_seconds(now - since)}"
                    )

    def _emit(self, line: str) -> None:
        """One whole plain line (one write, under the lock: the heartbeat writes too)."""
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def stop(self) -> None:
        """Stop the live table or the heartbeat: safe to call more than once."""
        if self._heart is not None:
            self._stopped.set()
            self._heart.join()
            self._heart = None
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
        text = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
        )
        if self.format == "plain":
            self._emit(f"done: {text}")  # one line, however long
        else:
            self.console.print(f"[bold]done[/bold]: {text}")
