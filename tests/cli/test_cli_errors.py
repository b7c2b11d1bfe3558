"""Bad input: each case exits non-zero with one clear line naming the thing, no traceback, and
leaves no partial adapter that looks complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance import config as C
from appliance.cli.main import main
from appliance.errors import ConfigError
from appliance.run.record import rebuild_unreadable_run_file, run_identity, write_run_file
from appliance.run.resume import decide_output, remove_previous_run
from appliance.storage import uri as storage
from appliance.storage.checkpoints import list_checkpoints, load_latest_checkpoint, save_checkpoint
from appliance.storage.output_lock import LOCK_FILE, OutputLock
from tests.helpers_cli import run_train, train_in_process
from tests.helpers_model import make_model
from tests.helpers_tokenizer import sentences

CONFIGS = Path(__file__).parents[2] / "appliance" / "configs"
pytest_plugins = ["tests.s3_server"]


def train(*argv: str) -> tuple[int, str]:
    """`appliance train ARGV` in this process. A test that takes `ray_local` runs it on the
    module's Ray (the driver joins a Ray already started; whether it starts one is not what
    those tests are about)."""
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
    """No adapter_config.json anywhere under `out`: nothing that looks like a finished adapter
    (checkpoints hold one too)."""
    if out.exists():
        assert not list(out.rglob("adapter_config.json")), list(out.rglob("*"))


def assert_one_user_error(code: int, output: str, out: Path | None, *needles: str) -> None:
    """One problem: exit 1, exactly one `error:` line holding every needle, no traceback, and
    no adapter under `out`."""
    assert_user_error(code, output, *needles)
    lines = error_lines(output)
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], (needle, output)
    if out is not None:
        assert_no_adapter(out)


def copy_model(model: Path, to: Path, *names: str) -> Path:
    to.mkdir()
    for name in names:
        shutil.copy(model / name, to / name)
    return to


def test_missing_model_directory(tmp_path, tiny_data):
    code, out = train("--model", tmp_path / "nope", "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(
        code, out, tmp_path / "o", str(tmp_path / "nope"), "no such file or directory"
    )


def test_a_model_file_given_for_its_directory_is_named(tmp_path, tiny_model, tiny_data):
    weights = tiny_model / "model.safetensors"
    code, out = train("--model", weights, "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(
        code,
        out,
        tmp_path / "o",
        f"--model {weights} is a file: pass the directory",
        str(tiny_model),
    )


def test_model_directory_without_config(tmp_path, tiny_data):
    (tmp_path / "empty").mkdir()
    code, out = train(
        "--model", tmp_path / "empty", "--data", tiny_data, "--output", tmp_path / "o"
    )
    assert_one_user_error(code, out, tmp_path / "o", "config.json")


def test_model_directory_with_config_but_no_safetensors(tmp_path, tiny_model, tiny_data):
    bare = copy_model(tiny_model, tmp_path / "bare", "config.json", "tokenizer.json")
    code, out = train("--model", bare, "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(
        code, out, tmp_path / "o", str(bare), "no model.safetensors", "safe_serialization=True"
    )


@pytest.mark.parametrize("damage", ["truncated", "garbled header"])
def test_corrupt_model_safetensors_is_refused_naming_the_file(
    tmp_path, tiny_model, tiny_data, damage
):
    broken = copy_model(tiny_model, tmp_path / "broken", "config.json", "tokenizer.json")
    weights = (tiny_model / "model.safetensors").read_bytes()
    if damage == "truncated":
        weights = weights[: len(weights) // 2]
    else:
        weights = b"\xff" * 8 + weights[8:]  # a header length far past the end of the file
    (broken / "model.safetensors").write_bytes(weights)
    code, out = train("--model", broken, "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(
        code, out, tmp_path / "o", str(broken / "model.safetensors"), "cannot read safetensors"
    )


def test_unsupported_architecture_is_refused_by_name_before_loading(
    tmp_path, tiny_model, tiny_data
):
    other = tmp_path / "gpt2"
    other.mkdir()
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))  # no weights at all: never read
    code, out = train("--model", other, "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(code, out, tmp_path / "o", "GPT2LMHeadModel", "not supported")


def test_missing_tokenizer(tmp_path, tiny_data):
    bare = make_model(tmp_path / "bare", "llama-mha", with_tokenizer=False)
    code, out = train("--model", bare, "--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(code, out, tmp_path / "o", "tokenizer.json")


def test_empty_dataset(tmp_path, tiny_model):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    code, out = train(
        "--model", tiny_model, "--data", tmp_path / "empty.jsonl", "--output", tmp_path / "o"
    )
    assert_one_user_error(code, out, tmp_path / "o", "empty.jsonl")


def test_seq_len_above_max_position_embeddings(tmp_path, tiny_model, tiny_data):
    code, out = train(
        "--model",
        tiny_model,
        "--data",
        tiny_data,
        "--output",
        tmp_path / "o",
        "--seq-len",
        "100000",
    )
    assert_one_user_error(code, out, tmp_path / "o", "--seq-len 100000", "max_position_embeddings")


def test_data_without_model_is_refused_instead_of_training_the_demo(tmp_path, tiny_data):
    code, out = train("--data", tiny_data, "--output", tmp_path / "o")
    assert_one_user_error(code, out, tmp_path / "o", "--data needs --model")
    assert not (tmp_path / "o").exists()


def test_train_where_ray_is_not_installed_says_what_to_install(
    tmp_path, tiny_model, tiny_data, monkeypatch
):
    """Ray is a dependency, but an install with --no-deps (the GPU machine's image) lacks it:
    `train` then says to install it, in one line, before it writes anything."""
    monkeypatch.setitem(sys.modules, "ray", None)  # None in sys.modules: `import ray` raises
    out = tmp_path / "out"
    code, output = train("--model", tiny_model, "--data", tiny_data, "--output", out, "--steps", 2)
    assert_one_user_error(code, output, out, "`appliance train` needs Ray", "pip install")
    assert not out.exists()


def test_every_bad_flag_is_reported_at_once_each_naming_its_flag():
    code, out = train("--seq-len", "abc", "--lr", "x", "--lora-rank", "0")
    assert_user_error(code, out)
    assert error_lines(out) == [
        "error: --seq-len: 'abc' is not a valid int",
        "error: --lr: 'x' is not a valid float",
        "error: --lora-rank must be ≥ 1 (got 0)",
    ]


def test_a_bad_choice_lists_the_choices_and_help_still_shows_them():
    code, out = train("--device", "tpu", "--log-format", "xml")
    assert_user_error(code, out)
    assert error_lines(out) == [
        "error: --device must be one of auto | cpu | cuda (got 'tpu')",
        "error: --log-format must be one of auto | rich | json | plain (got 'xml')",
    ]
    code, help_text = train("--help")
    assert code == 0 and "--device [auto|cpu|cuda]" in help_text


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


def test_output_holding_a_different_run_is_refused_unless_overwrite(
    tmp_path, tiny_model, tiny_data
):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text(
        json.dumps({"identity": {"model": "other"}, "status": "complete"})
    )
    code, text = train("--model", tiny_model, "--data", tiny_data, "--output", out)
    assert_one_user_error(code, text, out, "already holds a different run", "--overwrite")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, text = train("--model", tiny_model, "--data", tiny_data, "--output", other)
    assert_one_user_error(code, text, other, "not empty", "--overwrite")
    assert (other / "notes.txt").read_text() == "mine"


def test_an_output_another_train_is_writing_is_refused_naming_its_process(
    tmp_path, tiny_model, tiny_data
):
    """The lock is an flock: a second descriptor of the lock file, here the CLI's in this same
    process, is refused as another process would be. Released, it leaves no file, and no
    directory where it made one that nothing else wrote to."""
    out = tmp_path / "o"
    with OutputLock(str(out)):
        code, text = train("--model", tiny_model, "--data", tiny_data, "--output", out, "--resume")
        assert_one_user_error(
            code,
            text,
            out,
            f"another appliance train (pid {os.getpid()} on {socket.gethostname()})",
        )
        code, text = train(
            "--model", tiny_model, "--data", tiny_data, "--output", out, "--overwrite"
        )
        assert_one_user_error(code, text, out, "in use by another appliance train")
    assert not out.exists()
    out.mkdir()
    with OutputLock(str(out)):  # taken again: it names its holder
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()} on {socket.gethostname()}"
    assert out.is_dir() and not any(out.iterdir())  # the user's directory stays, the lock goes


def test_an_output_under_a_file_is_refused_before_ray_starts(tmp_path, tiny_model, tiny_data):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile / "sub", afile):
        code, text = train("--model", tiny_model, "--data", tiny_data, "--output", out)
        assert_one_user_error(code, text, None, f"--output {out}", "cannot create")
        assert "starting Ray" not in text
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("damage", [b'{"identity": {"mod', b"[]", b"\xff\xfe"])
def test_an_unreadable_run_json_is_named_and_overwrite_replaces_it(
    tmp_path, tiny_model, tiny_data, damage
):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_bytes(damage)
    (out / "notes.txt").write_text("mine")
    for extra in ((), ("--resume",)):
        code, text = train("--model", tiny_model, "--data", tiny_data, "--output", out, *extra)
        assert_one_user_error(code, text, out, f"{out / 'run.json'} is unreadable", "--overwrite")
    code, text = train("--output", out, "--resume")  # the resume that reads the run's config
    assert_one_user_error(code, text, out, "run.json is unreadable")
    cfg = C.build_config({}, {"model": "m", "data": "d", "output": str(out), "overwrite": True})
    decide_output(cfg)  # --overwrite does not need to read it: the run is replaced
    remove_previous_run(str(out))
    assert sorted(f.name for f in out.iterdir()) == ["notes.txt"]


@pytest.mark.integration
def test_a_resume_rebuilds_an_unreadable_run_json_from_the_latest_checkpoint(
    ray_local, tmp_path, tiny_model, tiny_data
):
    """A torn run.json beside good checkpoints: the error names the resume that keeps them
    (--overwrite would delete them), and `--resume` alone rebuilds run.json from the latest
    checkpoint, keeps the unreadable file beside it, and trains on from that step."""
    out = tmp_path / "o"
    args = [
        *data_args(tiny_model, tiny_data, "--steps", "2", "--checkpoint-every", "1"),
        "--output",
        out,
    ]
    code, text = train(*args)
    assert code == 0, text
    damage = (out / "run.json").read_bytes()[:40]  # cut short, as a full disk leaves it
    (out / "run.json").write_bytes(damage)
    latest = out / "checkpoints" / "step-000002"
    code, text = train(*args)
    assert_one_user_error(
        code, text, None, f"{out / 'run.json'} is unreadable",
        f"or continue the run from its latest checkpoint ({latest}): appliance train --output "
        f"{out} --resume rebuilds run.json from it; or pass --overwrite",
    )  # fmt: skip
    code, text = train("--output", out, "--resume", "--steps", "3")
    assert code == 0, text
    assert (
        f"note: {out / 'run.json'} was unreadable (it is not JSON (Unterminated string "
    ) in text
    assert f"rebuilt it from the latest checkpoint {latest}, and kept the unreadable file" in text
    assert (out / "run.json.unreadable").read_bytes() == damage
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["steps"]) == ("complete", 3)
    assert record["identity"]["seq_len"] == 16 and record["model_fingerprint"]  # recorded anew
    assert "resumed from step-000002 (step 2)" in text
    assert [c.step for c in list_checkpoints(str(out))][-1] == 3


def test_an_unreadable_run_json_on_s3_is_rebuilt_from_its_latest_checkpoint(s3_bucket, s3_client):
    """The rebuild under the S3 lease: run.json again from the latest checkpoint's config.json,
    the torn file kept beside it; a readable run.json, or none, is left as it is."""
    out = f"s3://{s3_bucket}/o"
    cfg = C.build_config({}, {"model": "m", "data": "d", "output": out, "seq_len": 48})
    assert rebuild_unreadable_run_file(out) is None  # no run.json: nothing to rebuild
    write_run_file(cfg, "running")
    assert rebuild_unreadable_run_file(out) is None  # readable: left as it is
    config = json.dumps(cfg.to_dict()).encode()
    save_checkpoint(out, 1, {"config.json": config}, keep=2)
    save_checkpoint(out, 2, {"config.json": config}, keep=2)
    storage.write_bytes(f"{out}/run.json", b'{"identity": ')
    note = rebuild_unreadable_run_file(out)
    assert note is not None and note.startswith(f"{out}/run.json was unreadable (it is not JSON")
    assert f"rebuilt it from the latest checkpoint {out}/checkpoints/step-000002" in note
    assert storage.read_bytes(f"{out}/run.json.unreadable") == b'{"identity": '
    record = json.loads(storage.read_bytes(f"{out}/run.json"))
    assert record["identity"] == run_identity(cfg) and record["config"] == cfg.to_dict()
    assert (record["status"], record["model_fingerprint"]) == ("interrupted", None)
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "o/.appliance.lock" not in keys  # the lease it took is released


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_left_running_is_shown_as_stopped_before_it_finished(where, tmp_path, request):
    """decide_output runs under the output's lock (a local flock, an S3 lease), so a run.json
    that says `running` is a run that stopped: on S3 too, where nothing told them apart."""
    if where == "s3":
        out = f"s3://{request.getfixturevalue('s3_bucket')}/o"
    else:
        (tmp_path / "o").mkdir()
        out = str(tmp_path / "o")
    cfg = C.build_config({}, {"model": "m", "data": "d", "output": out})
    write_run_file(cfg, "running")
    # before its first checkpoint it left nothing to keep: the new run takes its place
    decision = decide_output(cfg)
    assert decision.notes == (
        f"--output {out} held the same run that ended (stopped before it finished) before its "
        "first checkpoint: nothing of it to keep, starting this run in its place",
    )
    assert decision.replace and not cfg.overwrite  # `train` clears the old run.json; cfg as given
    storage.write_bytes(storage.join(out, "checkpoints", "step-000004", "adapter.bin"), b"")
    with pytest.raises(ConfigError, match=r"holds the same run \(stopped before it finished\)"):
        decide_output(cfg)


def data_args(model: Path, data: Path, *extra: str) -> list:
    return [
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
        *extra,
    ]


def write_lines(path: Path, bad: dict[int, str | bytes]) -> Path:
    """40 good records, with line `i` (0-based) replaced by bad[i]."""
    lines = [json.dumps({"text": s}).encode() for s in sentences(40)]
    for i, line in bad.items():
        lines[i] = line.encode() if isinstance(line, str) else line
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def assert_cli_user_error(done: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert done.returncode == 1, done.stderr[-2000:]
    assert_one_user_error(done.returncode, done.stderr, out, *needles)


@pytest.mark.integration
def test_a_run_that_fails_after_it_started_records_why_in_run_json(
    ray_local, tmp_path, tiny_model, tiny_data
):
    out = tmp_path / "o"
    failed = train_in_process(
        *data_args(tiny_model, tiny_data)[:-2], "--tokenize-workers", "64", "--output", out
    )
    assert_cli_user_error(failed, out, "--tokenize-workers 64 needs 65 CPUs")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed" and "--tokenize-workers 64" in record["error"]
    # it failed before its first checkpoint: the command, fixed, just runs (nothing to resume)
    code, text = train(*data_args(tiny_model, tiny_data, "--steps", "2"), "--output", out)
    assert code == 0, text
    assert f"--output {out} held the same run that ended (failed) before its first" in text
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    # ... while a run with a checkpoint is kept: continue it, or --overwrite it
    code, text = train(*data_args(tiny_model, tiny_data, "--steps", "2"), "--output", out)
    assert_one_user_error(code, text, None, "already holds the same run (complete)", "--resume")


@pytest.mark.integration
def test_a_validation_set_with_nothing_to_score_fails_before_the_first_step(
    ray_local, tmp_path, tiny_model
):
    """--eval-split so small that it holds out no document: refused before any training (not
    at the first eval, with the run's steps lost and a resume that fails the same way); the
    command with a larger split then starts afresh in the same --output."""
    data = write_lines(tmp_path / "data.jsonl", {})
    out = tmp_path / "o"
    args = [
        *data_args(tiny_model, data, "--steps", "2", "--checkpoint-every", "1"),
        "--output",
        out,
    ]
    failed = train_in_process(*args, "--eval-split", "0.001")
    assert_cli_user_error(
        failed,
        out,
        "--eval-split 0.001 (the documents held out of --data): no document has a target token",
    )
    assert "step 1" not in failed.stdout and not (out / "checkpoints").exists()
    code, text = train(*args, "--eval-split", "0.3")
    assert code == 0, text
    assert "held a different run that ended (failed) before its first checkpoint" in text


@pytest.mark.integration
def test_a_run_follows_its_model_to_a_new_path_and_no_other_model(
    ray_local, tmp_path, tiny_model, tiny_data
):
    """A moved model directory (another mount point in a container): `--resume` alone names the
    way on; `--resume --model NEW` continues when the files are the run's model's, and another
    model at that path is refused."""
    here = shutil.copytree(tiny_model, tmp_path / "here")
    out = tmp_path / "o"
    first = train_in_process(*data_args(here, tiny_data, "--steps", "2"), "--output", out)
    assert first.returncode == 0, first.stderr[-2000:]
    moved = here.rename(tmp_path / "moved")
    code, text = train("--output", out, "--resume")
    assert_one_user_error(code, text, None, f"the run's model {here} is not there", "--model")
    done = train_in_process("--output", out, "--resume", "--model", moved, "--steps", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["steps"], record["identity"]["model"]) == (
        "complete", 3, str(moved),
    )  # fmt: skip
    other = make_model(tmp_path / "other", "llama-mha", seed=1)  # same shapes, other weights
    code, text = train("--output", out, "--resume", "--model", other, "--steps", "4")
    assert_one_user_error(code, text, None, f"--model {other} (the run: {moved})")


@pytest.mark.integration
def test_a_resume_on_changed_data_is_refused_by_name_or_goes_on_when_allowed(
    ray_local, tmp_path, tiny_model
):
    """The run's data cursors count documents in its files: a file added to --data's directory
    since the run started stops `--resume`, naming it; `--allow-data-change` goes on and
    run.json records the data as it is now; a data directory that moved is named, with how to
    give its new place."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(30)))
    out = tmp_path / "o"
    first = train_in_process(*data_args(tiny_model, data, "--steps", "2"), "--output", out)
    assert first.returncode == 0, first.stderr[-2000:]
    (data / "b.jsonl").write_text(json.dumps({"text": "a document added later"}) + "\n")
    code, text = train("--output", out, "--resume", "--steps", "3")
    assert_one_user_error(
        code, text, None, f"--resume: --data {data} changed since the run started: 1 file(s) "
        "added (b.jsonl).", "--allow-data-change",
    )  # fmt: skip
    done = train_in_process("--output", out, "--resume", "--steps", "3", "--allow-data-change")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "added (b.jsonl); continuing on it, as --allow-data-change asks" in done.stdout
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["steps"]) == ("complete", 3)
    assert [name for name, _, _ in record["data_fingerprint"]["files"]] == ["a.jsonl", "b.jsonl"]
    data.rename(tmp_path / "moved")
    code, text = train("--output", out, "--resume", "--steps", "4")
    assert_one_user_error(
        code, text, None, f"the run's data {data} is not there any more",
        f"--output {out} --resume --data NEW_PATH",
    )  # fmt: skip
    typo = tmp_path / "mvoed"  # a new path given that is not there: not the run's data
    code, text = train("--output", out, "--resume", "--data", typo)
    assert_one_user_error(code, text, None, f"no such file or directory: {typo}: check the path")


@pytest.mark.integration
def test_malformed_jsonl_line_fails_naming_file_and_line(ray_local, tmp_path, tiny_model):
    data = write_lines(tmp_path / "data.jsonl", {7: '{"text": "unterminated'})
    done = train_in_process(
        *data_args(tiny_model, data, "--epochs", "1"), "--output", tmp_path / "o"
    )
    assert_cli_user_error(done, tmp_path / "o", f"{data}:8: malformed JSON")


@pytest.mark.integration
def test_a_bad_record_the_epoch_count_meets_is_recorded_and_the_fixed_command_runs(
    ray_local, tmp_path, tiny_model
):
    """A bad record past what the driver samples fails --epochs' counting pass (a Ray task):
    run.json says it as the CLI does, not as Ray's wrapper (a traceback); fixed, the same
    command runs: the run had no checkpoint, so no data cursor to keep."""
    texts = sentences(100)
    lines = [json.dumps({"text": t}) for t in texts]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines[:89] + ['{"text": 3}'] + lines[90:]) + "\n")
    out = tmp_path / "o"
    args = [*data_args(tiny_model, data, "--epochs", "1", "--seq-len", "64"), "--output", out]
    assert_cli_user_error(train_in_process(*args), out, f'{data}:90: "text" must be a string')
    error = json.loads((out / "run.json").read_text())["error"]
    assert error.startswith(f'DataError: {data}:90: "text" must be a string'), error
    assert "ray::" not in error and "Traceback" not in error
    data.write_text("\n".join(lines) + "\n")
    code, text = train(*args)
    assert code == 0, text
    assert "changed since the run started" not in text  # a new run, on the data as it is


@pytest.mark.integration
def test_records_without_text_fail_naming_file_and_line_or_are_skipped_and_counted_once(
    ray_local, tmp_path, tiny_model
):
    no_text = json.dumps({"body": "no text key"})
    data = write_lines(tmp_path / "data.jsonl", {7: no_text, 12: no_text})

    failed = train_in_process(
        *data_args(tiny_model, data, "--epochs", "1"), "--output", tmp_path / "o1"
    )
    assert_cli_user_error(failed, tmp_path / "o1", f'{data}:8: record has no "text"')

    # two epochs read each bad record twice; each is counted once
    skipped = train_in_process(
        *data_args(tiny_model, data, "--epochs", "2", "--on-bad-record", "skip"),
        "--output",
        tmp_path / "o2",
    )
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    record = json.loads((tmp_path / "o2" / "run.json").read_text())
    assert record["status"] == "complete" and record["skipped_records"] == 2
    assert "skipped_records 2" in skipped.stdout


@pytest.mark.integration
def test_non_utf8_jsonl_line_names_file_and_line(ray_local, tmp_path, tiny_model):
    data = write_lines(tmp_path / "data.jsonl", {4: b'{"text": "the cat \xff sat"}'})
    done = train_in_process(
        *data_args(tiny_model, data, "--steps", "2"), "--output", tmp_path / "o"
    )
    assert_cli_user_error(done, tmp_path / "o", f"{data}:5: not valid UTF-8")


@pytest.mark.integration
def test_non_utf8_text_names_the_file(ray_local, tmp_path, tiny_model):
    data = tmp_path / "bad.txt"
    data.write_bytes(b"the cat \xff\xfe sat")
    done = train_in_process(
        "--model",
        tiny_model,
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
    assert_cli_user_error(done, tmp_path / "o", str(data), "UTF-8")


def checkpoint_steps(out: Path) -> list[int]:
    return [c.step for c in list_checkpoints(str(out))]


@pytest.mark.integration
def test_overwrite_removes_the_old_run_before_the_new_one_writes_anything(
    ray_local, tmp_path, tiny_model, tiny_data
):
    out = tmp_path / "o"
    old = train_in_process(
        *data_args(
            tiny_model, tiny_data, "--steps", "4", "--checkpoint-every", "2", "--lora-rank", "4"
        ),
        "--output",
        out,
    )
    assert old.returncode == 0, old.stderr[-2000:]
    assert checkpoint_steps(out) == [2, 4] and (out / "adapter_config.json").is_file()
    (out / "notes.txt").write_text("mine")

    # a different run over it, killed while writing its first checkpoint
    new = data_args(tiny_model, tiny_data, "--steps", "3", "--lora-rank", "2", "--overwrite")
    killed = run_train(
        *new,
        "--checkpoint-every",
        "1",
        "--output",
        out,
        env={"APPLIANCE_FAULT_KILL_DURING_CHECKPOINT": "1"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "adapter_config.json").exists()  # no complete-looking adapter at all
    assert not (out / "adapter_model.safetensors").exists()
    ranks = [json.loads(p.read_text())["r"] for p in out.rglob("adapter_config.json")]
    assert set(ranks) <= {2}  # the torn checkpoint's own, if any: nothing of the old run (r=4)
    assert load_latest_checkpoint(str(out)) is None  # nothing of the old run to restore
    assert not set(checkpoint_steps(out)) & {2, 4}
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["identity"]["lora_rank"]) == ("running", 2)

    # the same run again, left alone: only the new run remains (and the user's file)
    done = train_in_process(*new, "--output", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert checkpoint_steps(out) == [3]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["steps"], record["identity"]["lora_rank"]) == (
        "complete",
        3,
        2,
    )
    assert (out / "notes.txt").read_text() == "mine"


def test_remove_previous_run_deletes_the_run_on_s3_and_keeps_other_files(s3_bucket, s3_client):
    keys = [
        "run/adapter_config.json",
        "run/adapter_model.safetensors",
        "run/checkpoints/latest",
        "run/checkpoints/step-000002/manifest.json",
        "run/checkpoints/step-000002/trainer_state.pt",
        "run/run.json",
        "run/notes.txt",
        "run-other/run.json",
    ]
    for key in keys:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"x")
    remove_previous_run(f"s3://{s3_bucket}/run")
    left = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert sorted(left) == ["run-other/run.json", "run/notes.txt"]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid_and_give_the_command_in_their_header(path):
    values = C.read_config_file(path)
    cfg = C.build_config(values, {"model": "/m", "data": "/d", "output": "/o"})
    assert cfg.seq_len >= 2048
    header = path.read_text().split("\n\n")[0]
    assert f"appliance train --config appliance/configs/{path.name}" in header


@pytest.mark.integration
def test_a_loss_that_is_not_finite_stops_the_run_before_an_adapter_of_nans(
    ray_local, tmp_path, tiny_model, tiny_data
):
    """One NaN in the base weights (a damaged download): the run fails at its first step,
    naming the loss and what to check, and publishes no adapter, rather than completing with
    every adapter value NaN."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "model"
    shutil.copytree(tiny_model, bad)
    weights = load_file(bad / "model.safetensors")
    name = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o"
    done = train_in_process(*data_args(bad, tiny_data, "--steps", "2"), "--output", out)
    assert_cli_user_error(
        done,
        out,
        "step 1: the loss is nan: the base model's weight model.layers.1.mlp.down_proj.weight "
        "holds inf or NaN",
        "no checkpoint",
        "fetch the model again",
    )
    # the failing step is not shown as done (a slow one may be shown as "running for")
    assert not re.search(r"^step 1/2 +loss", done.stdout, re.M), done.stdout
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed" and record["error"].startswith("TrainingError: step 1")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_an_unquoted_data_pattern_the_shell_expanded_is_said_to_need_quotes(tmp_path, command):
    """`--data data/*.jsonl` unquoted reaches appliance as several file names: click's "extra
    arguments" error says what happened and how to write it."""
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    result = CliRunner().invoke(main, [command, "--model", "m", "--data", *map(str, files)])
    assert result.exit_code == 2
    assert f"Got unexpected extra argument ({files[1]}): if --data is a pattern, quote it" in (
        result.output
    )
    other = CliRunner().invoke(main, ["plan", "--gpu", "a10", "--preset", "7b", "stray"])
    assert other.exit_code == 2 and "quote it" not in other.output  # (no --data: no hint)
