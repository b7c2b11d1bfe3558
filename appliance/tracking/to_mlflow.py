"""MLflow: one MLflow run per appliance run, through `MlflowClient` (no global state).

Where: `mlflow_tracking_uri` (else MLFLOW_TRACKING_URI, else MLflow's default, a sqlite:///
store in the working directory), experiment `mlflow_experiment_name` (else
MLFLOW_EXPERIMENT_NAME, else MLflow's `Default`), run name `mlflow_run_name` (else the output's
name). The config goes in as parameters (once: a resumed run keeps them), every history record's
figures as metrics under the record's keys (`loss`, `learning_rate`, `eval_loss`, ...), the
adapter's files as artifacts under `adapter/` (for a new experiment in a local sqlite:/// store, in
`mlartifacts/` beside the database). A resumed run continues the MLflow run whose id
run.json kept; steps it trains again after a kill are logged again (MLflow keeps both values)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from appliance.tracking.trackers import figures, run_name

MAX_PARAM = 500  # characters of a parameter's value (old MLflow servers take no more)
STATUS = {"complete": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class MLflow:
    def __init__(self) -> None:
        self.client = None
        self.run_id = ""
        self.uri = ""

    def open(self, settings: dict, ids: dict | None, start_step: int) -> dict:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.tracking import get_tracking_uri

        self.uri = (
            settings.get("mlflow_tracking_uri")
            or (ids or {}).get("tracking_uri")
            or get_tracking_uri()
        )
        self.client = MlflowClient(self.uri)
        if ids and ids.get("run_id"):
            self.run_id = ids["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return {**ids, "tracking_uri": self.uri}
        name = settings.get("mlflow_experiment_name") or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        experiment_id = "0"  # MLflow's Default experiment
        if name:
            found = self.client.get_experiment_by_name(name)
            experiment_id = (
                found.experiment_id
                if found
                else self.client.create_experiment(
                    name, artifact_location=_artifacts(self.uri, name)
                )
            )
        run = self.client.create_run(
            experiment_id, run_name=settings.get("mlflow_run_name") or run_name(settings)
        )
        self.run_id = run.info.run_id
        params = [
            Param(key, str(value)[:MAX_PARAM])
            for key, value in sorted(settings.items())
            if value is not None and value != ""
        ]
        for i in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        return {"run_id": self.run_id, "tracking_uri": self.uri, "experiment_id": experiment_id}

    def where(self) -> str:
        return f"run {self.run_id} at {self.uri}"

    def log(self, records: list[dict]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for record in records:
            kind, values = figures(record)
            for name, value in values.items():
                key = f"eval_{name}" if kind == "eval" else name
                metrics.append(Metric(key, float(value), now, record["step"]))
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def rewind(self, step: int) -> None:
        """MLflow keeps every value logged: the steps trained again are logged again."""

    def artifact(self, files: list[Path]) -> None:
        for f in files:
            self.client.log_artifact(self.run_id, str(f), "adapter")

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, STATUS.get(status, "FINISHED"))


def _artifacts(uri: str, experiment: str) -> str | None:
    """Where a new experiment of a local sqlite:/// store keeps its artifacts: beside the
    database (`mlartifacts/<experiment>`), not in whatever directory the run was started from
    (MLflow's `./mlruns`). None (the server's choice) for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" / experiment)
