"""Experiment tracking (`--report-to`): a run's history records, its config and its adapter sent
to TensorBoard, MLflow, Weights & Biases or Trackio, with the names the Hugging Face Trainer
gives them (`report_to`) and axolotl's keys for their settings (`wandb_project`,
`mlflow_tracking_uri`, ...).

    backends.py     the backends' names, their packages, and the one-line error for a backend
                    asked for but not installed (checked with the config, before any model loads)
    trackers.py     `Trackers`: every backend of a run behind one object (open, log, rewind,
                    artifact, close); a backend that fails mid-run is said once and dropped,
                    never the run
    to_tensorboard.py, to_mlflow.py, to_wandb.py, to_trackio.py: one backend each

Each backend's package is imported only when a run opens it: importing this package loads
nothing heavy. docs/tracking.md is the user's page."""

from appliance.tracking.backends import BACKENDS, backend_problems, parse_report_to
from appliance.tracking.trackers import Trackers

__all__ = ["BACKENDS", "Trackers", "backend_problems", "parse_report_to"]
