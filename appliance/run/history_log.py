"""The run's history: every step's and every validation's figures, one JSON object a line, in
`OUTPUT/history.jsonl` beside run.json (what Hugging Face's `trainer_state.json` keeps as
`log_history`, and with its key names: `step`, `epoch`, `loss`, `learning_rate`, `grad_norm`,
`eval_loss`).

    {"step": 3, "epoch": 0.75, "loss": 2.31, "learning_rate": 0.0002, "grad_norm": 0.9, ...}
    {"step": 4, "epoch": 1.0, "eval_loss": 2.12}

A training line per step, an evaluation line after each validation (after its step's line).
`read_history(output)` reads it back; so does any JSON Lines reader (pandas.read_json(...,
lines=True)). The experiment trackers (appliance/tracking/) are given these same records, so the
file and a tracker hold the same numbers.

It always holds the steps the latest checkpoint holds, once: a local file gets each line as the
step ends and is synced to disk before each checkpoint is published; an s3:// output (which
cannot append) gets the whole file written before each checkpoint and at the end. When a run
goes back to a checkpoint (`--resume`, a trainer restarted in the run), `rewind` drops the lines
of the steps after it, which are trained again, and puts back from the checkpoint's own loss
history (storage/history.py) any of its steps the file lacks (a file deleted or torn): those
lines hold the loss alone, marked `"from_checkpoint": true`. A torn last line (a driver killed
mid-write) is dropped. The file is rewritten whole only then, complete before it replaces the
old one."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from appliance.storage import uri as storage

HISTORY_FILE = "history.jsonl"

#: the step stats (Trainer.step, loop.py) a training line carries, as the line names them
STEP_KEYS = {
    "loss": "loss",
    "lr": "learning_rate",
    "grad_norm": "grad_norm",
    "tokens": "tokens",
    "target_tokens": "target_tokens",
    "step_seconds": "step_seconds",
    "h2d_bytes": "h2d_bytes",
    "h2d_seconds": "h2d_seconds",
    "flops": "flops",
    "gpu_busy_ratio": "gpu_busy_ratio",
    "gpu_mem_allocated": "gpu_memory_allocated_bytes",
    "gpu_mem_reserved": "gpu_memory_reserved_bytes",
    "host_rss": "host_memory_bytes",
    "loss_scale": "loss_scale",
    "target_share": "target_share",
}


def history_uri(output: str) -> str:
    return storage.join(output, HISTORY_FILE)


def _number(value: Any) -> Any:
    """A finite number as it is; inf or NaN (a float16 step that overflowed) as None, which
    strict JSON readers take."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def step_record(step: int, epoch: float | None, stats: dict) -> dict:
    """The training line of step `step` from its stats (loop.py's, which add up all ranks)."""
    record: dict[str, Any] = {"step": step}
    if epoch is not None:
        record["epoch"] = epoch
    for key, name in STEP_KEYS.items():
        if stats.get(key) is not None:
            record[name] = _number(stats[key])
    if stats.get("step_seconds"):
        record["tokens_per_second"] = stats["tokens"] / stats["step_seconds"]
    phases = stats.get("phase_seconds") or {}
    if "data_wait" in phases:
        record["data_wait_seconds"] = phases["data_wait"]
    if stats.get("skipped_step"):
        record["skipped_step"] = True
    return record


def eval_record(step: int, epoch: float | None, eval_loss: float) -> dict:
    record: dict[str, Any] = {"step": step}
    if epoch is not None:
        record["epoch"] = epoch
    record["eval_loss"] = eval_loss
    return record


def _parse(data: bytes) -> list[dict]:
    """The records of a history file; a line that does not parse (a torn last line) is left
    out."""
    records = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def read_history(output: str) -> list[dict]:
    """Every record of the run in `output` (local or s3://), in order; [] when it has none."""
    uri = history_uri(output)
    return _parse(storage.read_bytes(uri)) if storage.exists(uri) else []


def _encode(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


class HistoryLog:
    """The writer of one run's history.jsonl (see the module's docstring)."""

    def __init__(self, output: str):
        self.uri = history_uri(output)
        self.local = not storage.is_s3(output)
        self.records: list[dict] = []  # s3://: the whole file, written at each flush
        self._file = None  # local: the file, open to append

    def rewind(self, step: int, losses: list[float], evals: list[list]) -> str | None:
        """Make the file hold steps 1..`step` exactly, as the checkpoint the run is at holds
        them (`losses` of steps 1..step, `evals` [step, eval loss]): later steps' lines are
        dropped, missing ones put back from the checkpoint. A note saying what changed, or None."""
        self.close()
        before = _parse(storage.read_bytes(self.uri)) if storage.exists(self.uri) else []
        kept = [r for r in before if r["step"] <= step]
        trained = {r["step"] for r in kept if "loss" in r}
        validated = {r["step"] for r in kept if "eval_loss" in r}
        restored = [
            {"step": s, "loss": loss, "from_checkpoint": True}
            for s, loss in enumerate(losses[:step], start=1)
            if s not in trained
        ]
        restored += [
            {"step": int(s), "eval_loss": loss, "from_checkpoint": True}
            for s, loss in evals
            if int(s) <= step and int(s) not in validated
        ]
        records = kept + restored
        records.sort(key=lambda r: (r["step"], "eval_loss" in r))  # stable: file order kept
        if records != before or not storage.exists(self.uri):
            storage.write_bytes(self.uri, _encode(records))  # complete, then replaces the old
        self.records = records
        dropped = len({r["step"] for r in before if r["step"] > step})
        said = []
        if dropped:
            said.append(f"{dropped} step(s) after step {step} left out (they are trained again)")
        if restored:
            said.append(f"{len(restored)} line(s) put back from the checkpoint's losses")
        return f"{HISTORY_FILE}: {'; '.join(said)}" if said else None

    def append(self, records: list[dict]) -> None:
        """Add `records` (local: written now, to the OS; durable at the next flush)."""
        if not self.local:
            self.records += records
            return
        if self._file is None:
            path = storage.to_local(self.uri)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab")  # noqa: SIM115 - kept open for the run's appends
        self._file.write(_encode(records))
        self._file.flush()

    def flush(self) -> None:
        """Make what was appended durable: before a checkpoint is published, and at the end."""
        if not self.local:
            storage.write_bytes(self.uri, _encode(self.records))
        elif self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
