"""Where a run's figures go besides the display and Prometheus: its history file
(history_log.py, OUTPUT/history.jsonl) and the experiment trackers of --report-to
(appliance/tracking/), given the same records. The trackers' run ids live in run.json
(`tracking`), so a resumed run continues the tracked runs it started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from appliance.config import TrainConfig
from appliance.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from appliance.run.history_log import HistoryLog
from appliance.storage import uri as storage
from appliance.tracking import Trackers

CARD = "README.md"  # the adapter's model card (adapter/model_card.py), an artifact beside it


class RunReport:
    """history.jsonl and the trackers of one run. `ids`: run.json's `tracking` of the run being
    resumed (None for a fresh run)."""

    def __init__(self, cfg: TrainConfig, note: Callable[[str], None], ids: dict | None = None):
        self.cfg, self.note = cfg, note
        self.log = HistoryLog(str(cfg.output))
        self.trackers = Trackers(tuple(cfg.report_to), cfg.to_dict(), ids, note)

    @property
    def ids(self) -> dict:
        """What run.json keeps of the trackers (run ids, where they are)."""
        return self.trackers.ids

    def open_trackers(self, start_step: int) -> None:
        """Start (or, resumed, continue) every tracked run, at `start_step`."""
        self.trackers.open(start_step)

    def rewind(self, step: int, losses: list[float], evals: list[list]) -> None:
        """The run is at the checkpoint of `step` (a resume, a restarted trainer)."""
        if note := self.log.rewind(step, losses, evals):
            self.note(note)
        self.trackers.rewind(step)

    def append(self, records: list[dict]) -> None:
        """One step's records (its training line, and its validation's when it validated)."""
        self.log.append(records)
        self.trackers.log(records)

    def flush(self) -> None:
        """history.jsonl made durable: before each checkpoint is published, and at the end."""
        self.log.flush()

    def finish(self) -> None:
        """The run is complete, its adapter written: the adapter to the trackers that keep
        files, and every tracked run ended as finished."""
        self.log.flush()
        self.log.close()
        if self.trackers.open_backends:
            output = str(self.cfg.output)
            if storage.is_s3(output):
                self.note("tracking: the adapter is in an s3:// output, not sent as an artifact")
            else:
                files = [Path(output) / n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, CARD)]
                self.trackers.artifact([f for f in files if f.is_file()])
        self.trackers.close("complete")

    def close(self, status: str) -> None:
        """The run stopped (`failed`, `interrupted`): the tracked runs end so, the file closes."""
        self.log.close()
        self.trackers.close(status)
