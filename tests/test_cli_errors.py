"""Bad input: each case exits non-zero with one clear line naming the thing, no traceback, and
leaves no partial adapter that looks complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import config as C
from appliance.cli import main
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences
from tests.test_faults import free_port

CONFIGS = Path(__file__).parent.parent / "appliance" / "configs"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "model", "llama-mha")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(30)))
    return path


def train(*argv: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["train", *map(str, argv)])
    return result.exit_code, result.output


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def assert_user_error(code: int, output: str, *needles: str) -> None:
    assert code == 1, output
    assert "Traceback" not in output
    assert error_lines(output), output
    for needle in needles:
        assert needle in output, (needle, output)


def assert_no_adapter(out: Path) -> None:
    assert not (out / "adapter_config.json").exists()


def test_missing_model_directory(tmp_path, data):
    code, out = train("--model", tmp_path / "nope", "--data", data, "--output", tmp_path / "o")
    assert_user_error(code, out, str(tmp_path / "nope"), "no such file or directory")
    assert_no_adapter(tmp_path / "o")


def test_model_directory_without_config(tmp_path, data):
    (tmp_path / "empty").mkdir()
    code, out = train("--model", tmp_path / "empty", "--data", data, "--output", tmp_path / "o")
    assert_user_error(code, out, "config.json")


def test_unsupported_architecture_is_refused_by_name_before_loading(tmp_path, model, data):
    other = tmp_path / "gpt2"
    other.mkdir()
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))  # no weights at all: never read
    code, out = train("--model", other, "--data", data, "--output", tmp_path / "o")
    assert_user_error(code, out, "GPT2LMHeadModel", "not supported")


def test_missing_tokenizer(tmp_path, data):
    bare = make_model(tmp_path / "bare", "llama-mha", with_tokenizer=False)
    code, out = train("--model", bare, "--data", data, "--output", tmp_path / "o")
    assert_user_error(code, out, "tokenizer.json")


def test_empty_dataset(tmp_path, model):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    code, out = train(
        "--model", model, "--data", tmp_path / "empty.jsonl", "--output", tmp_path / "o"
    )
    assert_user_error(code, out, "empty.jsonl")


def test_seq_len_above_max_position_embeddings(tmp_path, model, data):
    code, out = train(
        "--model", model, "--data", data, "--output", tmp_path / "o", "--seq-len", "100000"
    )
    assert_user_error(code, out, "--seq-len 100000", "max_position_embeddings")


def test_every_config_error_is_reported_at_once_naming_flags_and_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seq_lenn: 12\nlora_rank: 0\nlr: fast\n")
    code, out = train("--config", cfg, "--micro-batch-size", "0")
    assert_user_error(
        code,
        out,
        f"error: --config {cfg}: unknown key 'seq_lenn' (did you mean 'seq_len'?)",
        f"error: --config {cfg}: lora_rank must be ≥ 1 (got 0)",
        f"error: --config {cfg}: lr: 'fast' is not a valid float",
        "error: --micro-batch-size must be ≥ 1 (got 0)",
    )
    assert len(error_lines(out)) == 4


def test_output_holding_a_different_run_is_refused_unless_overwrite(tmp_path, model, data):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text(
        json.dumps({"identity": {"model": "other"}, "status": "complete"})
    )
    code, text = train("--model", model, "--data", data, "--output", out)
    assert_user_error(code, text, "already holds a different run", "--overwrite")
    (out / "notes.txt").unlink(missing_ok=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, text = train("--model", model, "--data", data, "--output", other)
    assert_user_error(code, text, "not empty", "--overwrite")
    assert (other / "notes.txt").read_text() == "mine"


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "train",
            *map(str, argv),
            "--metrics-port",
            str(free_port()),
            "--log-format",
            "plain",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


@pytest.mark.integration
def test_malformed_jsonl_line_fails_with_file_and_line_or_is_skipped_and_counted(tmp_path, model):
    data = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": s}) for s in sentences(40)]
    lines[7] = '{"text": "unterminated'
    lines[12] = json.dumps({"body": "no text key"})
    data.write_text("\n".join(lines) + "\n")
    common = [
        "--model",
        model,
        "--data",
        data,
        "--seq-len",
        "16",
        "--micro-batch-size",
        "2",
        "--tokenize-workers",
        "1",
        "--epochs",
        "1",
    ]

    failed = run_cli(*common, "--output", tmp_path / "o1")
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert f"error: {data}:8" in failed.stderr and "Traceback" not in failed.stderr
    assert_no_adapter(tmp_path / "o1")

    skipped = run_cli(*common, "--output", tmp_path / "o2", "--on-bad-record", "skip")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    record = json.loads((tmp_path / "o2" / "run.json").read_text())
    assert record["skipped_records"] == 2
    assert "skipped_records 2" in skipped.stdout


@pytest.mark.integration
def test_non_utf8_text_names_the_file(tmp_path, model):
    data = tmp_path / "bad.txt"
    data.write_bytes(b"the cat \xff\xfe sat")
    done = run_cli(
        "--model",
        model,
        "--data",
        data,
        "--output",
        tmp_path / "o",
        "--seq-len",
        "8",
        "--tokenize-workers",
        "1",
        "--steps",
        "2",
    )
    assert done.returncode == 1
    assert str(data) in done.stderr and "UTF-8" in done.stderr and "Traceback" not in done.stderr
    assert_no_adapter(tmp_path / "o")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid_and_give_the_command_in_their_header(path):
    values = C.read_config_file(path)
    cfg = C.build_config(values, {"model": "/m", "data": "/d", "output": "/o"})
    assert cfg.seq_len >= 2048
    header = path.read_text().split("\n\n")[0]
    assert f"appliance train --config appliance/configs/{path.name}" in header
