"""TensorBoard: event files under `logging_dir` (default OUTPUT/runs), written with PyTorch's
SummaryWriter; tags `train/loss`, `train/learning_rate`, ..., `eval/loss`. A resumed run writes
a new event file beside the earlier ones with a purge step: TensorBoard then drops the earlier
files' events from that step on (steps trained again after a kill), so each step shows once."""

from __future__ import annotations

from pathlib import Path

from appliance.tracking.trackers import figures


def logging_dir(settings: dict) -> str:
    """Where the event files go: --logging-dir, else OUTPUT/runs."""
    return str(settings.get("logging_dir") or Path(str(settings["output"])) / "runs")


class TensorBoard:
    def __init__(self) -> None:
        self.writer = None
        self.dir = ""

    def open(self, settings: dict, ids: dict | None, start_step: int) -> dict:
        self.dir = logging_dir(settings)
        self._start(start_step)
        return {"logging_dir": self.dir}

    def _start(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        purge = start_step + 1 if start_step else None  # what follows replaces what was
        self.writer = SummaryWriter(self.dir, purge_step=purge)

    def where(self) -> str:
        return f"event files in {self.dir} (tensorboard --logdir {self.dir})"

    def log(self, records: list[dict]) -> None:
        for record in records:
            kind, values = figures(record)
            for name, value in values.items():
                self.writer.add_scalar(f"{kind}/{name}", value, record["step"])
        self.writer.flush()

    def rewind(self, step: int) -> None:
        self._start(step)

    def artifact(self, files: list[Path]) -> None:
        """TensorBoard keeps no files."""

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
