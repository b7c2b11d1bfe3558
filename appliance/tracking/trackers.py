"""Every tracking backend of one run behind one object.

The run hands `Trackers` the records it appends to history.jsonl (run/history_log.py), so a
tracker holds the same numbers as the file: a training record's figures under `train/<name>`
and a validation's under `eval/<name>` (TensorBoard, W&B, Trackio: the Hugging Face Trainer's
tags), or under the record's own keys (`loss`, `learning_rate`, `eval_loss`: MLflow, as the
Trainer's MLflow callback names them), each at the record's step.

Opening a backend that cannot start (an MLflow server that refuses, a W&B login missing) is a
TrackingError, one line, before the first step. Once the run trains, a backend that fails is
said once and left out for the rest of the run: tracking never stops a training run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError


class TrackingError(ApplianceError):
    """A tracker asked for could not be opened."""


#: backend name -> module (appliance/tracking/) and class
MODULES = {
    "tensorboard": ("appliance.tracking.to_tensorboard", "TensorBoard"),
    "mlflow": ("appliance.tracking.to_mlflow", "MLflow"),
    "wandb": ("appliance.tracking.to_wandb", "WandB"),
    "trackio": ("appliance.tracking.to_trackio", "Trackio"),
}
NOT_METRICS = ("step", "from_checkpoint")  # a record's keys that are no figure


def figures(record: dict) -> tuple[str, dict[str, float]]:
    """("train" or "eval", the record's numbers by name: `eval_loss` as `loss` for eval)."""
    kind = "eval" if "eval_loss" in record else "train"
    out = {}
    for key, value in record.items():
        if key in NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key.removeprefix("eval_") if kind == "eval" else key] = value
    return kind, out


def run_name(settings: dict) -> str:
    """A run's default name in a tracker: its --output's last part."""
    output = str(settings.get("output") or "appliance").rstrip("/")
    return output.rsplit("/", 1)[-1] or "appliance"


class Trackers:
    """The backends `names` of one run; `settings` is its config (TrainConfig.to_dict()), `ids`
    what run.json kept of an earlier invocation of the same run (so a resumed run continues its
    tracked runs), `note` prints a line for the user."""

    def __init__(self, names: tuple[str, ...], settings: dict, ids: dict | None, note: Callable):
        self.names, self.settings, self.note = names, settings, note
        self.ids: dict[str, Any] = dict(ids or {})
        self.open_backends: dict[str, Any] = {}

    def open(self, start_step: int) -> dict:
        """Open every backend at `start_step` (0 for a fresh run); the ids to keep in run.json."""
        for name in self.names:
            module, cls = MODULES[name]
            backend = getattr(importlib.import_module(module), cls)()
            try:
                self.ids[name] = backend.open(self.settings, self.ids.get(name), start_step)
            except Exception as e:  # noqa: BLE001 - the backend's own errors, said in one line
                self.close("failed")
                raise TrackingError(
                    f"--report-to {name}: could not start tracking: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                ) from None
            self.open_backends[name] = backend
            if where := backend.where():
                self.note(f"tracking: {name} {where}")
        return self.ids

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for name, backend in list(self.open_backends.items()):
            try:
                call(backend)
            except Exception as e:  # noqa: BLE001 - tracking never stops the run
                del self.open_backends[name]
                self.note(
                    f"warning: --report-to {name}: {what} failed ({type(e).__name__}: {e}); "
                    "it is left out for the rest of the run (history.jsonl has every step)"
                )

    def log(self, records: list[dict]) -> None:
        self._each("logging", lambda b: b.log(records))

    def rewind(self, step: int) -> None:
        """The run went back to the checkpoint of `step` (a trainer restarted): what comes next
        is logged from step + 1 again."""
        self._each("rewinding", lambda b: b.rewind(step))

    def artifact(self, files: list[Path]) -> None:
        """The adapter's files, to the backends that keep artifacts (MLflow, W&B)."""
        self._each("the adapter artifact", lambda b: b.artifact(files))

    def close(self, status: str) -> None:
        """End every tracked run: `status` is run.json's (complete, failed, interrupted)."""
        self._each("closing", lambda b: b.close(status))
        self.open_backends.clear()
