"""Weights & Biases: one W&B run per appliance run.

Settings: `wandb_project` (else WANDB_PROJECT, else "appliance"), `wandb_entity`, `wandb_name`
(else the output's name), `wandb_mode` (online | offline | disabled; else WANDB_MODE), and
`wandb_run_id` to continue a W&B run of your own; W&B reads its other variables (WANDB_API_KEY,
WANDB_DIR, ...) itself. The run directory is OUTPUT/wandb for a local output, unless WANDB_DIR
says otherwise. The config goes in as the run's config, each history record's figures under
`train/<name>` and `eval/<name>` at its step, the adapter as a `model` artifact. A resumed run
continues the W&B run whose id run.json kept (W&B takes steps only forward: steps trained again
after a kill are not logged twice)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from appliance.tracking.trackers import figures, run_name


class WandB:
    def __init__(self) -> None:
        self.run = None

    def open(self, settings: dict, ids: dict | None, start_step: int) -> dict:
        import wandb

        run_id = (ids or {}).get("run_id") or settings.get("wandb_run_id") or secrets.token_hex(4)
        output = str(settings.get("output") or "")
        directory = None
        if output and "://" not in output and not os.environ.get("WANDB_DIR"):
            directory = output  # W&B makes OUTPUT/wandb/
        self.run = wandb.init(
            project=settings.get("wandb_project") or os.environ.get("WANDB_PROJECT") or "appliance",
            entity=settings.get("wandb_entity") or None,
            name=settings.get("wandb_name") or os.environ.get("WANDB_NAME") or run_name(settings),
            mode=settings.get("wandb_mode") or None,
            id=run_id,
            resume="allow",
            dir=directory,
            config=settings,
        )
        return {"run_id": run_id, "project": self.run.project}

    def where(self) -> str:
        return f"run {self.run.id} in {self.run.dir}"

    def log(self, records: list[dict]) -> None:
        for record in records:
            kind, values = figures(record)
            self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=record["step"])

    def rewind(self, step: int) -> None:
        """W&B takes steps only forward: the steps trained again are not logged twice."""

    def artifact(self, files: list[Path]) -> None:
        import wandb

        art = wandb.Artifact(f"adapter-{self.run.id}", type="model")
        for f in files:
            art.add_file(str(f))
        self.run.log_artifact(art)

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "complete" else 1)
            self.run = None
