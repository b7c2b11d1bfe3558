"""appliance.storage.checkpoints: complete-then-publish checkpoints on local disk and on S3 (moto)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest

from appliance.storage import checkpoints as checkpoint
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    CheckpointError,
    list_checkpoints,
    load_latest_checkpoint,
    read_file,
    save_checkpoint,
    verify_checkpoint,
)

pytest_plugins = ["tests.s3_server"]


@pytest.fixture(params=["local", "s3"])
def output_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An ``--output`` URI: a local dir or a prefix in a fresh moto bucket."""
    if request.param == "local":
        return str(tmp_path / "run")
    return f"s3://{request.getfixturevalue('s3_bucket')}/runs/r1"


def files_for(step: int) -> dict[str, bytes]:
    return {
        "adapter_model.safetensors": bytes([step % 256]) * 1000,
        "optimizer.pt": f"optimizer state at {step}".encode() * 10,
        "state.json": checkpoint.json_bytes({"step": step, "lr": 1e-4, "cursors": [3, 4]}),
        "workers/0.json": checkpoint.json_bytes({"cursor": step * 7}),
    }


def ckpt_uri(output_uri: str, step: int) -> str:
    return storage.join(output_uri, "checkpoints", checkpoint.checkpoint_name(step))


def names(output_uri: str) -> list[str]:
    return [i.name for i in list_checkpoints(output_uri)]


class SimulatedKill(BaseException):
    """Stands in for SIGKILL: not an Exception, so no cleanup handler runs."""


def fail_on_write(monkeypatch: pytest.MonkeyPatch, n: int, exc: BaseException) -> list[str]:
    """Make the n-th storage.write_bytes call (1-based) raise ``exc``; returns the URIs written."""
    real = storage.write_bytes
    written: list[str] = []

    def write(uri: str, data: bytes) -> None:
        if len(written) + 1 == n:
            raise exc
        real(uri, data)
        written.append(uri)

    monkeypatch.setattr(storage, "write_bytes", write)
    return written


# ---------------------------------------------------------------------------------- happy path


def test_save_then_load_round_trip(output_uri: str) -> None:
    assert load_latest_checkpoint(output_uri) is None  # nothing saved yet

    uri = save_checkpoint(output_uri, 123, files_for(123), keep=3)
    assert uri == ckpt_uri(output_uri, 123)
    assert uri.endswith("checkpoints/step-000123")
    marker = storage.join(output_uri, "checkpoints", "latest")
    assert storage.read_bytes(marker).decode().strip() == "step-000123"

    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None
    assert (ckpt.step, ckpt.name, ckpt.uri) == (123, "step-000123", uri)
    assert ckpt.files == files_for(123)
    assert ckpt.json("state.json")["cursors"] == [3, 4]
    assert ckpt.skipped == []

    manifest = json.loads(storage.read_bytes(storage.join(uri, "manifest.json")))
    assert manifest["step"] == 123
    assert manifest["created"]
    entries = {e["name"]: e for e in manifest["files"]}
    assert set(entries) == set(files_for(123))
    assert entries["adapter_model.safetensors"]["size"] == 1000
    assert len(entries["optimizer.pt"]["sha256"]) == 64
    assert verify_checkpoint(uri) == []


def test_marker_is_written_last(output_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    written = fail_on_write(monkeypatch, n=-1, exc=RuntimeError("never"))
    save_checkpoint(output_uri, 5, files_for(5), keep=2)
    tails = [w.replace("\\", "/").split("/")[-1] for w in written]
    assert tails[-1] == "latest"
    assert tails[-2] == "manifest.json"
    assert sorted(tails[:-2]) == sorted(n.split("/")[-1] for n in files_for(5))


def test_keep_k_prunes_oldest(output_uri: str) -> None:
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(output_uri, step, files_for(step), keep=2)
    assert names(output_uri) == ["step-000040", "step-000050"]
    assert all(i.complete for i in list_checkpoints(output_uri))
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 50
    assert storage.list_files(ckpt_uri(output_uri, 10)) == []


def test_resave_same_step_replaces_it(output_uri: str) -> None:
    save_checkpoint(output_uri, 7, {"a.bin": b"first", "only-in-first": b"x"}, keep=2)
    save_checkpoint(output_uri, 7, {"a.bin": b"second"}, keep=2)
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.files == {"a.bin": b"second"}
    assert storage.list_files(ckpt_uri(output_uri, 7)) == ["a.bin", "manifest.json"]


def test_resume_from_earlier_step_follows_marker(output_uri: str) -> None:
    """A run resumed at step 1 and saving step 2 publishes 2, even though 3 exists on disk from
    the abandoned run (which pruning leaves alone)."""
    for step in (1, 2, 3):
        save_checkpoint(output_uri, step, files_for(step), keep=5)
    save_checkpoint(output_uri, 2, files_for(2), keep=1)
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 2
    assert names(output_uri) == ["step-000002", "step-000003"]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep must be >= 1"):
        save_checkpoint(str(tmp_path), 1, {"a": b""}, keep=0)
    for bad in ("../escape", "/abs", "manifest.json", "a//b", ""):
        with pytest.raises(CheckpointError, match="bad checkpoint file name"):
            save_checkpoint(str(tmp_path), 1, {bad: b"x"}, keep=1)
    with pytest.raises(CheckpointError, match="expected bytes"):
        save_checkpoint(str(tmp_path), 1, {"a": "text"}, keep=1)  # type: ignore[dict-item]
    assert list_checkpoints(str(tmp_path)) == []


def test_checkpoint_error_pickles() -> None:
    err = CheckpointError("all bad", ["x/a.bin: sha256 mismatch (corrupt)"])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.problems) == ("all bad", ["x/a.bin: sha256 mismatch (corrupt)"])


# ---------------------------------------------------------------------------------- damage


def flip_byte(uri: str, at: int = 10) -> None:
    data = bytearray(storage.read_bytes(uri))
    data[at] ^= 0xFF
    storage.write_bytes(uri, bytes(data))


def test_corrupt_latest_falls_back_naming_the_file(
    output_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(output_uri, 1, files_for(1), keep=3)
    save_checkpoint(output_uri, 2, files_for(2), keep=3)
    bad = storage.join(ckpt_uri(output_uri, 2), "adapter_model.safetensors")
    flip_byte(bad)

    problems = verify_checkpoint(ckpt_uri(output_uri, 2))
    assert len(problems) == 1 and bad in problems[0] and "sha256" in problems[0]

    with caplog.at_level(logging.WARNING, logger="appliance.storage.checkpoints"):
        ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None
    assert ckpt.step == 1 and ckpt.files == files_for(1)
    assert any(bad in s for s in ckpt.skipped)
    assert bad in caplog.text


def test_truncated_latest_falls_back(output_uri: str) -> None:
    save_checkpoint(output_uri, 1, files_for(1), keep=3)
    save_checkpoint(output_uri, 2, files_for(2), keep=3)
    bad = storage.join(ckpt_uri(output_uri, 2), "optimizer.pt")
    storage.write_bytes(bad, storage.read_bytes(bad)[:5])

    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 1
    assert any(bad in s and "truncated" in s for s in ckpt.skipped)


def test_missing_manifest_or_file_falls_back(output_uri: str) -> None:
    for step in (1, 2, 3):
        save_checkpoint(output_uri, step, files_for(step), keep=3)
    storage.delete(storage.join(ckpt_uri(output_uri, 3), "manifest.json"))
    missing = storage.join(ckpt_uri(output_uri, 2), "workers/0.json")
    storage.delete(missing)

    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 1
    assert any("step-000003" in s and "manifest.json: missing" in s for s in ckpt.skipped)
    assert any(missing in s for s in ckpt.skipped)


def test_all_corrupt_raises_naming_each_file(output_uri: str) -> None:
    save_checkpoint(output_uri, 1, files_for(1), keep=3)
    save_checkpoint(output_uri, 2, files_for(2), keep=3)
    bad1 = storage.join(ckpt_uri(output_uri, 1), "state.json")
    bad2 = storage.join(ckpt_uri(output_uri, 2), "optimizer.pt")
    flip_byte(bad1)
    flip_byte(bad2)
    with pytest.raises(CheckpointError) as info:
        load_latest_checkpoint(output_uri)
    assert bad1 in str(info.value) and bad2 in str(info.value)
    assert len(info.value.problems) == 2


def test_only_reads_those_files_and_checks_the_others_sizes(output_uri: str) -> None:
    """The driver resumes reading only its small state: the big files it does not read are
    still checked for presence and size, so a checkpoint whose trainer state is missing or
    truncated is skipped (or, all bad, an error) before any model loads."""
    for step in (1, 2, 3):
        save_checkpoint(output_uri, step, files_for(step), keep=3)
    truncated = storage.join(ckpt_uri(output_uri, 3), "optimizer.pt")
    storage.write_bytes(truncated, storage.read_bytes(truncated)[:5])
    missing = storage.join(ckpt_uri(output_uri, 2), "adapter_model.safetensors")
    storage.delete(missing)

    ckpt = load_latest_checkpoint(output_uri, only=("state.json",))
    assert ckpt is not None and ckpt.step == 1
    assert ckpt.files == {"state.json": files_for(1)["state.json"]}  # the others not read
    assert any(truncated in s and "truncated" in s for s in ckpt.skipped)
    assert any(missing in s and "missing" in s for s in ckpt.skipped)

    # a flipped byte keeps the size: only a full read finds it (rank 0's, which falls back)
    flip_byte(storage.join(ckpt_uri(output_uri, 1), "optimizer.pt"))
    assert load_latest_checkpoint(output_uri, only=("state.json",)).step == 1
    with pytest.raises(CheckpointError):
        load_latest_checkpoint(output_uri)

    storage.delete(storage.join(ckpt_uri(output_uri, 1), "optimizer.pt"))
    with pytest.raises(CheckpointError) as info:
        load_latest_checkpoint(output_uri, only=("state.json",))
    assert truncated in str(info.value) and missing in str(info.value)
    assert len(info.value.problems) == 3


def test_a_streamed_file_is_written_as_it_is_produced_and_read_later_checked(
    output_uri: str,
) -> None:
    """A Stream (a function yielding chunks) is written chunk by chunk, hashed as it goes: the
    checkpoint is the one its bytes make. Read later with read_file, it is checked then."""
    files = files_for(7)
    produced: list[int] = []

    def stream():
        data = files["optimizer.pt"]
        for i in range(0, len(data), 64):
            produced.append(i)
            yield memoryview(data)[i : i + 64]

    uri = save_checkpoint(output_uri, 7, {**files, "optimizer.pt": stream}, keep=2)
    assert len(produced) > 1
    ckpt = load_latest_checkpoint(output_uri, only=lambda name: name != "optimizer.pt")
    assert "optimizer.pt" not in ckpt.files and ckpt.files["state.json"] == files["state.json"]
    assert read_file(ckpt, "optimizer.pt") == files["optimizer.pt"]
    assert verify_checkpoint(uri) == []

    flip_byte(storage.join(uri, "optimizer.pt"))
    with pytest.raises(CheckpointError, match="optimizer.pt: does not match the manifest"):
        read_file(ckpt, "optimizer.pt")


def test_marker_pointing_at_nothing_raises(output_uri: str) -> None:
    storage.write_bytes(storage.join(output_uri, "checkpoints", "latest"), b"step-000009\n")
    with pytest.raises(CheckpointError, match="step-000009: named by latest but missing"):
        load_latest_checkpoint(output_uri)


# ---------------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("exc", [SimulatedKill(), OSError("disk full")], ids=["kill", "error"])
def test_crash_mid_write_keeps_previous(
    output_uri: str, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    save_checkpoint(output_uri, 1, files_for(1), keep=3)
    with monkeypatch.context() as patch, pytest.raises(type(exc)):
        fail_on_write(patch, n=2, exc=exc)  # the second file of step 2
        save_checkpoint(output_uri, 2, files_for(2), keep=3)

    marker = storage.join(output_uri, "checkpoints", "latest")
    assert storage.read_bytes(marker).decode().strip() == "step-000001"
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 1 and ckpt.files == files_for(1)
    assert ckpt.skipped == []  # an unpublished partial write is not a bad checkpoint

    if storage.is_s3(output_uri):
        # S3 has no rename: the partial dir exists but has no manifest, so it is incomplete.
        infos = {i.name: i.complete for i in list_checkpoints(output_uri)}
        assert infos == {"step-000001": True, "step-000002": False}
        assert storage.list_files(ckpt_uri(output_uri, 2)) == ["adapter_model.safetensors"]
    else:
        # Locally no directory with the final name ever appears half-written.
        root = Path(output_uri) / "checkpoints"
        assert not (root / "step-000002").exists()
        assert names(output_uri) == ["step-000001"]
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
        assert len(leftovers) == (1 if isinstance(exc, SimulatedKill) else 0)

    # The next save succeeds and clears the debris.
    save_checkpoint(output_uri, 2, files_for(2), keep=3)
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 2 and ckpt.files == files_for(2)
    assert names(output_uri) == ["step-000001", "step-000002"]
    if not storage.is_s3(output_uri):
        assert sorted(p.name for p in (Path(output_uri) / "checkpoints").iterdir()) == [
            "latest",
            "step-000001",
            "step-000002",
        ]


def test_crash_between_manifest_and_marker(
    output_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 is complete on storage but unpublished: loading still follows the marker."""
    save_checkpoint(output_uri, 1, files_for(1), keep=3)
    with monkeypatch.context() as patch, pytest.raises(SimulatedKill):
        fail_on_write(patch, n=len(files_for(2)) + 2, exc=SimulatedKill())  # the marker
        save_checkpoint(output_uri, 2, files_for(2), keep=3)
    assert verify_checkpoint(ckpt_uri(output_uri, 2)) == []
    ckpt = load_latest_checkpoint(output_uri)
    assert ckpt is not None and ckpt.step == 1


def test_partial_dir_below_new_step_is_pruned_on_s3(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = f"s3://{s3_bucket}/run"
    save_checkpoint(out, 1, files_for(1), keep=3)
    with monkeypatch.context() as patch, pytest.raises(SimulatedKill):
        fail_on_write(patch, n=2, exc=SimulatedKill())
        save_checkpoint(out, 2, files_for(2), keep=3)
    save_checkpoint(out, 3, files_for(3), keep=3)
    assert names(out) == ["step-000001", "step-000003"]  # the unfinished step 2 is gone
