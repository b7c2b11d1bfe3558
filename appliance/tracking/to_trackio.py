"""Trackio (Hugging Face's local-first tracker, W&B's API): one Trackio run per appliance run,
in project TRACKIO_PROJECT (else `wandb_project`, else "appliance"), named as the output
(`wandb_name` when given); each record's figures under `train/<name>` and `eval/<name>`. A
resumed run continues the run of that name (resume="allow")."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.tracking.trackers import figures, run_name


class Trackio:
    def __init__(self) -> None:
        self.run = None

    def open(self, settings: dict, ids: dict | None, start_step: int) -> dict:
        import trackio

        project = os.environ.get("TRACKIO_PROJECT") or settings.get("wandb_project") or "appliance"
        name = (ids or {}).get("name") or settings.get("wandb_name") or run_name(settings)
        self.run = trackio.init(project=project, name=name, config=settings, resume="allow")
        return {"project": project, "name": name}

    def where(self) -> str:
        return ""

    def log(self, records: list[dict]) -> None:
        import trackio

        for record in records:
            kind, values = figures(record)
            trackio.log({f"{kind}/{k}": v for k, v in values.items()}, step=record["step"])

    def rewind(self, step: int) -> None:
        """Trackio keeps what was logged: the steps trained again are logged again."""

    def artifact(self, files: list[Path]) -> None:
        """Trackio keeps no files."""

    def close(self, status: str) -> None:
        import trackio

        if self.run is not None:
            trackio.finish()
            self.run = None
