"""One-line errors, not tracebacks, for inputs that crashed or were taken silently (issue 44,
item 8): zero or inconsistent shapes in config.json (before the RAM estimate), a NUL byte in a
path, nan or inf for a float flag, --lora-rank larger than the layer it adapts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.cli.main import main
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "model", "llama-mha")


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(30)))
    return path


def one_error(argv: list, *needles: str) -> str:
    """The command fails with exit 1, no traceback and exactly one `error:` line holding every
    needle; that line."""
    result = CliRunner().invoke(main, [str(a) for a in argv])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def with_config(model: Path, to: Path, **changes) -> Path:
    shutil.copytree(model, to)
    cfg = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**cfg, **changes}))
    return to


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"num_attention_heads": 0}, "num_attention_heads is 0, not a whole number ≥ 1"),
        ({"hidden_size": 1e9}, "hidden_size is 1000000000.0, not a whole number ≥ 1"),
        ({"num_hidden_layers": -2}, "num_hidden_layers is -2"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of"),
    ],
)
def test_bad_shapes_in_config_json_are_named_by_every_command(tmp_path, model, data, changes, said):
    bad = with_config(model, tmp_path / "bad", **changes)
    where = f"{bad / 'config.json'}: {said}"
    one_error(["train", "--model", bad, "--data", data, "--output", tmp_path / "o"], where)
    one_error(["plan", "--model", bad, "--gpu", "a10"], where)
    doctor = CliRunner().invoke(main, ["doctor", "--model", str(bad)])  # its table: one row
    assert doctor.exit_code == 1 and "Traceback" not in doctor.output
    failed = [line for line in doctor.output.splitlines() if line.startswith("fail")]
    assert len(failed) == 1 and failed[0].startswith("fail  model") and where in failed[0]


def test_a_hidden_size_the_weights_do_not_have_is_named_before_the_ram_estimate(
    tmp_path, model, data
):
    bad = with_config(model, tmp_path / "bad", hidden_size=2**20, intermediate_size=2**20)
    line = one_error(
        ["train", "--model", bad, "--data", data, "--output", tmp_path / "o"],
        "config.json implies",
    )
    assert "RAM" not in line


@pytest.mark.parametrize("flag", ["--data", "--output", "--model"])
def test_a_nul_byte_in_a_path_is_one_line(tmp_path, model, data, flag):
    paths = {"--model": str(model), "--data": str(data), "--output": str(tmp_path / "o")}
    paths[flag] += "\0x"
    argv = ["train", *[a for kv in paths.items() for a in kv]]
    one_error(argv, flag, "NUL byte")


def test_a_nul_byte_in_eval_and_export_paths_is_one_line(tmp_path, model):
    one_error(["eval", "--adapter", f"{tmp_path}\0x"], "--adapter", "NUL byte")
    one_error(
        ["export", "--adapter", tmp_path, "--output", f"{tmp_path}/m\0"], "--output", "NUL byte"
    )


@pytest.mark.parametrize(
    "flag, value",
    [("--lr", "nan"), ("--lr", "inf"), ("--lora-alpha", "-inf"), ("--min-lr-ratio", "nan")],
)
def test_nan_and_inf_are_refused_for_float_flags(tmp_path, model, data, flag, value):
    one_error(
        ["train", "--model", model, "--data", data, "--output", tmp_path / "o", flag, value],
        f"{flag}: '{value}' is not a finite number",
    )
    assert not (tmp_path / "o").exists()


def test_nan_in_a_config_file_and_in_plan_is_refused(tmp_path, model, data):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: .nan\n")
    one_error(
        ["train", "--config", cfg, "--model", model, "--data", data, "--output", tmp_path / "o"],
        "lr:",
        "is not a finite number",
    )
    one_error(
        ["plan", "--model", model, "--gpu", "a10", "--price-per-hour", "nan"],
        "--price-per-hour: nan is not a finite number",
    )


def test_a_lora_rank_larger_than_the_layer_is_one_line_before_ray(tmp_path, model, data):
    line = one_error(
        ["train", "--model", model, "--data", data, "--output", tmp_path / "o",
         "--lora-rank", "100000"],
        "--lora-rank 100000 is larger than the layer it adapts",
        "give --lora-rank 64 or less",
    )  # fmt: skip
    assert "starting Ray" not in line
