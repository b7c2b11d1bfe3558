"""--overwrite removes only what appliance wrote, and only where its run.json or its checkpoints'
manifests show appliance wrote there (issue 44, item 1): a directory that holds no appliance run
is refused, nothing in it deleted; in one that does, the user's files (another tool's
checkpoints too) stay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import config as C
from appliance.cli.main import main
from appliance.errors import ConfigError
from appliance.run.resume import decide_output, remove_previous_run
from appliance.storage.checkpoints import list_checkpoints, save_checkpoint


def overwrite_cfg(out: Path) -> C.TrainConfig:
    return C.build_config({}, {"model": "m", "data": "d", "output": str(out), "overwrite": True})


def users_checkpoints(out: Path) -> Path:
    """Another tool's checkpoint, as the issue planted it: checkpoints/epoch-3/model.pt."""
    mine = out / "checkpoints" / "epoch-3" / "model.pt"
    mine.parent.mkdir(parents=True)
    mine.write_text("x")
    return mine


def appliance_run(out: Path) -> None:
    """What an appliance run leaves: run.json, two checkpoints, the adapter."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps({"identity": {"model": "m"}, "status": "complete"}))
    for step in (2, 4):
        save_checkpoint(str(out), step, {"adapter_model.safetensors": b"w"}, keep=3)
    (out / "adapter_config.json").write_text('{"r": 4}')
    (out / "adapter_model.safetensors").write_bytes(b"w")


def test_overwrite_of_a_directory_with_no_appliance_run_is_refused_and_deletes_nothing(
    tmp_path, tiny_model, tiny_data
):
    """The issue's reproduction: `checkpoints/epoch-3/model.pt`, then train --overwrite."""
    out = tmp_path / "d"
    mine = users_checkpoints(out)
    (out / "adapter_config.json").write_text('{"theirs": true}')
    code_out = CliRunner().invoke(
        main, ["train", "--model", str(tiny_model), "--data", str(tiny_data), "--output", str(out),
               "--overwrite"],
    )  # fmt: skip
    assert code_out.exit_code == 1, code_out.output
    assert "Traceback" not in code_out.output
    errors = [line for line in code_out.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, code_out.output
    assert f"--output {out}" in errors[0] and "holds no appliance run" in errors[0]
    assert "removes only what appliance wrote" in errors[0]
    assert mine.read_text() == "x"
    assert (out / "adapter_config.json").read_text() == '{"theirs": true}'
    remove_previous_run(str(out))  # called on its own too, it finds nothing of appliance's
    assert mine.read_text() == "x"
    assert (out / "adapter_config.json").read_text() == '{"theirs": true}'


def test_a_home_directory_is_refused_and_its_checkpoints_stay(tmp_path):
    """`--output ~ --overwrite` deleted ~/checkpoints."""
    home = tmp_path / "home"
    mine = users_checkpoints(home)
    (home / ".bashrc").write_text("alias x=y")
    with pytest.raises(ConfigError, match="holds no appliance run"):
        decide_output(overwrite_cfg(home))
    assert mine.read_text() == "x" and (home / ".bashrc").is_file()


def test_the_refusal_of_a_non_empty_output_does_not_suggest_overwrite(tmp_path):
    out = tmp_path / "d"
    users_checkpoints(out)
    cfg = C.build_config({}, {"model": "m", "data": "d", "output": str(out)})
    with pytest.raises(ConfigError) as e:
        decide_output(cfg)
    assert "holds no appliance run" in str(e.value)
    assert "or pass --overwrite" not in str(e.value)


def test_overwrite_of_an_appliance_run_removes_only_what_it_wrote(tmp_path):
    out = tmp_path / "run"
    appliance_run(out)
    mine = users_checkpoints(out)
    (out / "notes.txt").write_text("mine")
    (out / "README.md").write_text("my own readme")
    stray = out / "checkpoints" / ".tmp-step-000006-abcd"  # an interrupted save of the run
    stray.mkdir()
    (stray / "manifest.json").write_text("{}")
    decide_output(overwrite_cfg(out))
    remove_previous_run(str(out))
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == ["README.md", "checkpoints/epoch-3/model.pt", "notes.txt"]
    assert mine.read_text() == "x" and (out / "README.md").read_text() == "my own readme"


def test_checkpoints_whose_manifest_is_appliances_go_without_run_json_others_stay(tmp_path):
    """No run.json (deleted by hand): the checkpoint layout still shows appliance wrote the
    step dirs whose manifest is its own; a step-N directory of another tool stays."""
    out = tmp_path / "run"
    save_checkpoint(str(out), 2, {"a.bin": b"w"}, keep=3)
    other = out / "checkpoints" / "step-000009"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "another-tool", "step": 9, "files": []}')
    (other / "weights.bin").write_text("theirs")
    decide_output(overwrite_cfg(out))
    remove_previous_run(str(out))
    assert [c.name for c in list_checkpoints(str(out))] == ["step-000009"]
    assert (other / "weights.bin").read_text() == "theirs"
    assert not (out / "checkpoints" / "latest").exists()


def test_adapter_files_no_run_json_accounts_for_are_refused(tmp_path):
    out = tmp_path / "run"
    save_checkpoint(str(out), 2, {"a.bin": b"w"}, keep=3)
    (out / "adapter_model.safetensors").write_bytes(b"theirs")
    with pytest.raises(ConfigError, match="adapter_model.safetensors are not recorded"):
        decide_output(overwrite_cfg(out))
    assert (out / "adapter_model.safetensors").read_bytes() == b"theirs"


def test_train_help_says_what_overwrite_removes_and_never_touches():
    text = " ".join(CliRunner().invoke(main, ["train", "--help"]).output.split())
    at = text.index("--overwrite")
    said = text[at : at + 600]
    for needle in ("only what appliance wrote", "run.json", "checkpoints/step-N", "Never touches"):
        assert needle in said, (needle, said)


def test_overwrite_of_a_full_finetune_removes_its_model_files_and_only_those(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    config = {"model": "m", "finetuning_type": "full"}
    (out / "run.json").write_text(json.dumps({"config": config, "status": "complete"}))
    written = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "generation_config.json"]  # fmt: skip
    for name in written:
        (out / name).write_text("x")
    (out / "model.pt").write_text("mine")  # not a name a full fine-tune writes
    (out / "notes.txt").write_text("mine")
    decide_output(overwrite_cfg(out))
    remove_previous_run(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["model.pt", "notes.txt"]
