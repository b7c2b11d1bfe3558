"""--report-to's settings and the Trackers object, in-process (the run itself, with every
backend read back by its own reader: tests/tracking/test_tracked_runs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.config import build_config
from appliance.errors import ConfigError
from appliance.tracking import Trackers, backend_problems, parse_report_to
from appliance.tracking.backends import PACKAGES
from appliance.tracking.trackers import figures


def test_report_to_takes_hf_names_comma_separated_repeated_and_none():
    assert parse_report_to(["tensorboard, MLflow", "wandb", "mlflow"]) == (
        "tensorboard", "mlflow", "wandb",
    )  # fmt: skip
    assert parse_report_to(["none"]) == ()
    cfg = build_config({"report_to": ["tensorboard"]}, {"model": "m", "data": "d", "output": "o"})
    assert cfg.report_to == ("tensorboard",)
    with pytest.raises(ConfigError) as e:
        build_config({}, {"model": "m", "data": "d", "output": "o", "report_to": "tensorbord"})
    assert str(e.value) == (
        "--report-to: 'tensorbord' is not a tracker: give some of tensorboard, mlflow, wandb, "
        "trackio (comma-separated), or none"
    )


def test_a_tracker_not_installed_is_one_line_before_anything_loads(monkeypatch, tmp_path):
    monkeypatch.setitem(PACKAGES, "wandb", ("not_a_module_here", "wandb"))
    assert backend_problems(("wandb",)) == [
        "--report-to wandb: the wandb package is not installed here: pip install "
        "'appliance[wandb]' (or 'appliance[tracking]' for every tracker)"
    ]
    result = CliRunner().invoke(
        main,
        ["train", "--model", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"),
         "--output", str(tmp_path / "o"), "--report-to", "tensorboard", "--report-to", "wandb"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"error: {backend_problems(('wandb',))[0]}"]
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_figures_take_every_number_of_a_record_by_its_kind():
    assert figures({"step": 2, "epoch": 0.5, "loss": 1.0, "grad_norm": None}) == (
        "train", {"epoch": 0.5, "loss": 1.0},
    )  # fmt: skip
    assert figures({"step": 2, "eval_loss": 0.5, "from_checkpoint": True}) == (
        "eval", {"loss": 0.5},
    )  # fmt: skip


def test_tensorboard_shows_each_step_once_after_the_run_went_back_to_a_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"output": str(tmp_path)}
    first = Trackers(("tensorboard",), settings, None, print)
    ids = first.open(0)
    first.log([{"step": s, "loss": 10.0 + s} for s in (1, 2, 3)])  # step 3: after checkpoint 2
    first.close("failed")
    again = Trackers(("tensorboard",), settings, ids, print)  # resumed at checkpoint 2
    again.open(2)
    again.log([{"step": s, "loss": float(s)} for s in (3, 4)])
    again.close("complete")
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert shown == [(1, 11.0), (2, 12.0), (3, 3.0), (4, 4.0)]
    assert np.float32(shown[0][1]) == np.float32(11.0)


def test_trackio_holds_the_records_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    """Trackio is not in the `test` extra (it would downgrade Pillow under wandb): this runs where
    it is installed (pip install 'appliance[trackio]')."""
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    settings = {"output": str(tmp_path / "run-a"), "lr": 0.1}
    first = Trackers(("trackio",), settings, None, print)
    ids = first.open(0)
    first.log([{"step": 1, "loss": 2.0, "learning_rate": 0.1}, {"step": 1, "eval_loss": 1.5}])
    first.close("interrupted")
    again = Trackers(("trackio",), settings, ids, print)
    again.open(1)
    again.log([{"step": 2, "loss": 1.25}])
    again.close("complete")
    logs = SQLiteStorage.get_logs("appliance", "run-a")
    assert [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in logs] == [
        (1, 2.0, None), (1, None, 1.5), (2, 1.25, None),
    ]  # fmt: skip
