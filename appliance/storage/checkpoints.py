"""Checkpoint directories on any storage URI, complete-then-publish.

Layout under ``--output`` (a local dir or ``s3://bucket/prefix``)::

    checkpoints/
      step-000100/   <files...>  manifest.json
      step-000200/   <files...>  manifest.json
      latest         "step-000200\\n"   (written last: the publish point)

A checkpoint is complete once its ``manifest.json`` (step, and each file's size and sha256) is
written, which happens after every file. Locally the whole step dir is first written under a
hidden temp name and renamed into place, so a crash never leaves a half directory with a final
name; on S3 the manifest is what marks completion. ``latest`` is written only after that, then
old checkpoints are pruned. Loading verifies every file against the manifest and falls back to
the previous complete checkpoint when the latest is corrupt, truncated or incomplete.

The module knows nothing about torch or PEFT: callers pass bytes (adapter safetensors,
``torch.save`` of optimizer state into a buffer, JSON for cursors/RNG/config via
:func:`json_bytes`), or, for a file too big to hold at once (a full fine-tune's weight shards),
a :data:`Stream`: a function that yields the file's bytes in chunks as it is written. Files are
written one at a time, each hashed as it goes, and the manifest made from what was written: a
save holds no more than the file it is writing (and none of a stream's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from appliance.errors import NOT_FOUND, ApplianceError, StorageError
from appliance.storage import uri as storage
from appliance.storage.names import why_outside

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"  # beside the checkpoints: the run's record (run/record.py)
CHECKPOINTS_DIR = "checkpoints"
LATEST_MARKER = "latest"
MANIFEST = "manifest.json"
CONFIG_FILE = "config.json"  # in every checkpoint: the run's resolved config
DRIVER_STATE = "driver_state.json"  # step, schedule position, worker cursors, losses
FORMAT = "appliance-checkpoint/1"
_NAME_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"  # local temp step dirs: ".tmp-step-000123-<random>"
# Tests: the run dies by SIGKILL in the middle of writing the checkpoint of this step.
FAULT_ENV = "APPLIANCE_FAULT_KILL_DURING_CHECKPOINT"
# ... with the driver's pid here, which the driver passes to its actors (the writer is rank 0)
FAULT_PID_ENV = "APPLIANCE_FAULT_DRIVER_PID"

#: A checkpoint file given as a function that yields its bytes in chunks (bytes, or flat byte
#: memoryviews), called once when the file is written
Stream = Callable[[], Iterable[bytes | memoryview]]
FileData = bytes | bytearray | memoryview | Stream


class CheckpointError(ApplianceError):
    """No usable checkpoint, or a bad save request. ``problems`` lists each bad file."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across Ray processes
        return (type(self), (str(self), self.problems))


@dataclass(frozen=True)
class CheckpointInfo:
    """A step directory found under ``<output>/checkpoints``; ``complete`` = has a manifest."""

    step: int
    name: str
    uri: str
    complete: bool


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: every file matched the manifest's size and sha256.

    ``skipped`` holds the problems of newer checkpoints passed over to reach this one.
    """

    step: int
    name: str
    uri: str
    files: dict[str, bytes]
    manifest: dict[str, Any]
    skipped: list[str] = field(default_factory=list)

    def json(self, name: str) -> Any:
        """Parse one of the checkpoint's files as JSON."""
        return json.loads(self.files[name])


def json_bytes(obj: Any) -> bytes:
    """Serialize ``obj`` as stable, readable JSON bytes for a checkpoint file."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint for ``step``: ``step-000123``."""
    return f"step-{step:06d}"


def checkpoints_uri(output_uri: str) -> str:
    """``<output>/checkpoints``."""
    return storage.join(output_uri, CHECKPOINTS_DIR)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_file_names(files: dict[str, FileData]) -> None:
    for name in files:
        parts = name.split("/")
        if (
            not name
            or name.startswith("/")
            or "\\" in name
            or any(p in ("", ".", "..") for p in parts)
            or name in (MANIFEST, LATEST_MARKER)
        ):
            raise CheckpointError(
                f"bad checkpoint file name {name!r}: use a relative '/'-separated name other "
                f"than {MANIFEST!r}"
            )
        if not isinstance(files[name], (bytes, bytearray, memoryview)) and not callable(
            files[name]
        ):
            raise CheckpointError(
                f"checkpoint file {name!r} is {type(files[name]).__name__}, expected bytes or "
                "a function yielding them (serialize it first, e.g. json_bytes(obj))"
            )


def _manifest(step: int, name: str, written: dict[str, tuple[int, str]]) -> bytes:
    """The manifest of the files `written` (name → (size, sha256))."""
    now = time.time()
    return json_bytes(
        {
            "format": FORMAT,
            "step": step,
            "name": name,
            "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            "created_unix": now,
            "files": [
                {"name": n, "size": written[n][0], "sha256": written[n][1]} for n in sorted(written)
            ],
        }
    )


def write_file(uri: str, data: FileData) -> tuple[int, str]:
    """Write one file of bytes or a Stream (storage.write_bytes, storage.write_chunks); its
    (size, sha256), a stream's hashed chunk by chunk as it is written."""
    if not callable(data):
        raw = bytes(data)
        storage.write_bytes(uri, raw)
        return len(raw), _sha256(raw)
    digest, size = hashlib.sha256(), 0

    def hashed() -> Iterator[bytes | memoryview]:
        nonlocal size
        for chunk in data():
            digest.update(chunk)
            size += memoryview(chunk).nbytes
            yield chunk

    storage.write_chunks(uri, hashed())
    return size, digest.hexdigest()


@contextlib.contextmanager
def fault_injection(step: int) -> Iterator[None]:
    """If $APPLIANCE_FAULT_KILL_DURING_CHECKPOINT names this step, the run dies by SIGKILL after
    the checkpoint's first file is written: the driver ($APPLIANCE_FAULT_DRIVER_PID, when the
    writer is another process), then the writer. How the tests prove a torn write loses
    nothing."""
    if os.environ.get(FAULT_ENV) != str(step):
        yield
        return
    real_write, real_chunks = storage.write_bytes, storage.write_chunks

    def die() -> None:
        driver = int(os.environ.get(FAULT_PID_ENV) or os.getpid())
        if driver != os.getpid():
            os.kill(driver, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def write_then_die(uri: str, data: bytes) -> None:
        real_write(uri, data)
        die()

    def chunks_then_die(uri: str, chunks: Iterable[bytes | memoryview]) -> None:
        real_chunks(uri, chunks)
        die()

    storage.write_bytes, storage.write_chunks = write_then_die, chunks_then_die
    try:
        yield
    finally:
        storage.write_bytes, storage.write_chunks = real_write, real_chunks


def save_checkpoint(output_uri: str, step: int, files: dict[str, FileData], keep: int) -> str:
    """Write ``<output>/checkpoints/step-NNNNNN/`` and publish it; return its URI.

    Order: every file, then ``manifest.json``, then the ``latest`` marker, then pruning to the
    ``keep`` newest complete checkpoints (the new one and the one ``latest`` names always stay;
    checkpoints with a higher step than this one, left by an abandoned run, are not touched).
    Re-saving an existing step replaces it. `files`: name → bytes, or a Stream (written as
    it yields, never held whole).
    """
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    _check_file_names(files)
    name = checkpoint_name(step)
    root = checkpoints_uri(output_uri)
    final = storage.join(root, name)
    t0 = time.perf_counter()

    if storage.is_s3(final):
        if storage.exists(final):  # an earlier, possibly partial, attempt at this step
            storage.delete(storage.join(final, MANIFEST))  # un-complete it first
            storage.delete_prefix(final)
        written = {f: write_file(storage.join(final, f), files[f]) for f in sorted(files)}
        storage.write_bytes(storage.join(final, MANIFEST), _manifest(step, name, written))
    else:
        _save_local(Path(storage.join(root, name)).expanduser(), step, files)

    storage.write_bytes(storage.join(root, LATEST_MARKER), f"{name}\n".encode())
    _prune(output_uri, step, keep)
    logger.info("checkpoint %s saved in %.2fs", final, time.perf_counter() - t0)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_local(final: Path, step: int, files: dict[str, FileData]) -> None:
    """Write into a hidden temp dir next to ``final``, then rename it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        written = {f: write_file(str(tmp / f), files[f]) for f in sorted(files)}
        storage.write_bytes(str(tmp / MANIFEST), _manifest(step, final.name, written))
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step: move the old one aside, then swap
            old = final.parent / f"{_TMP_PREFIX}{final.name}-old-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(final.parent)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_checkpoints(output_uri: str) -> list[CheckpointInfo]:
    """Step directories under ``<output>/checkpoints``, oldest step first (temp dirs left by an
    interrupted local save are not listed)."""
    root = checkpoints_uri(output_uri)
    dirs: dict[str, bool] = {}
    for rel in storage.list_files(root):
        top, sep, rest = rel.partition("/")
        if not sep or not _NAME_RE.match(top):
            continue
        dirs[top] = dirs.get(top, False) or rest == MANIFEST
    infos = [
        CheckpointInfo(int(n[len("step-") :]), n, storage.join(root, n), c) for n, c in dirs.items()
    ]
    return sorted(infos, key=lambda i: (i.step, i.name))


def is_appliance_checkpoint(uri: str) -> bool:
    """Whether the step directory at ``uri`` holds a manifest appliance wrote (its ``format``):
    what lets --overwrite tell appliance's checkpoints from another tool's of the same name."""
    try:
        manifest = json.loads(storage.read_bytes(storage.join(uri, MANIFEST)))
    except StorageError as e:
        if e.kind == NOT_FOUND:
            return False
        raise
    except ValueError:
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def temp_dirs(output_uri: str) -> list[Path]:
    """The hidden temp step dirs an interrupted local save left under ``<output>/checkpoints``
    (none on S3)."""
    root = checkpoints_uri(output_uri)
    if storage.is_s3(root):
        return []
    base = Path(root).expanduser()
    return sorted(p for p in base.glob(f"{_TMP_PREFIX}step-*") if p.is_dir() and not p.is_symlink())


def _read_marker(output_uri: str) -> str | None:
    uri = storage.join(checkpoints_uri(output_uri), LATEST_MARKER)
    try:
        return storage.read_bytes(uri).decode("utf-8", "replace").strip()
    except StorageError as e:
        if e.kind == NOT_FOUND:
            return None
        raise


#: which of a checkpoint's files to read: their names, or a test of a name
Only = Collection[str] | Callable[[str], bool] | None


def _reads(only: Only, name: str) -> bool:
    return only is None or (only(name) if callable(only) else name in only)


def _load_verified(
    uri: str, only: Only = None
) -> tuple[dict[str, Any] | None, dict[str, bytes], list[str]]:
    """Read a checkpoint dir and check it against its manifest: (manifest, files, problems).
    `only`: read and check just those of the manifest's files; the others are not read, only
    their sizes checked (a missing or truncated trainer state is found before a model loads;
    read_file reads one of them later, checked then)."""
    manifest_uri = storage.join(uri, MANIFEST)
    try:
        raw = storage.read_bytes(manifest_uri)
    except StorageError as e:
        if e.kind == NOT_FOUND:
            return None, {}, [f"{manifest_uri}: missing (the checkpoint was never completed)"]
        raise
    try:
        manifest = json.loads(raw)
        int(manifest["step"])
        entries = manifest["files"]
        if not isinstance(entries, list):
            raise TypeError("files is not a list")
        expected = {str(e["name"]): (int(e["size"]), str(e["sha256"])) for e in entries}
    except (ValueError, KeyError, TypeError) as e:
        return None, {}, [f"{manifest_uri}: unreadable manifest ({e})"]

    files: dict[str, bytes] = {}
    problems: list[str] = []
    for fname, (want_size, want_sha) in expected.items():
        if (why := why_outside(fname)) is not None:  # a tampered manifest: never read outside
            problems.append(f"{manifest_uri}: names {fname!r}, outside the checkpoint ({why})")
            continue
        furi = storage.join(uri, fname)
        size_only = not _reads(only, fname)
        try:
            data = None if size_only else storage.read_bytes(furi)
            size = storage.size(furi) if data is None else len(data)
        except StorageError as e:
            if e.kind != NOT_FOUND:
                raise
            problems.append(f"{furi}: missing")
            continue
        if size != want_size:
            problems.append(
                f"{furi}: size {size} bytes, manifest says {want_size} (truncated or overwritten)"
            )
        elif data is None:
            continue
        elif _sha256(data) != want_sha:
            problems.append(f"{furi}: sha256 mismatch (corrupt)")
        else:
            files[fname] = data
    return manifest, files, problems


def read_file(ckpt: Checkpoint, name: str) -> bytes:
    """One file of `ckpt` that was not read with it (`only`), read now and checked against the
    manifest: CheckpointError naming the file when it is missing, truncated or corrupt."""
    entry = next((e for e in ckpt.manifest["files"] if e["name"] == name), None)
    furi = storage.join(ckpt.uri, name)
    if entry is None:
        raise CheckpointError(f"{furi}: not in the checkpoint's manifest", [furi])
    try:
        data = storage.read_bytes(furi)
    except StorageError as e:
        if e.kind != NOT_FOUND:
            raise
        raise CheckpointError(f"{furi}: missing", [furi]) from None
    if len(data) != int(entry["size"]) or _sha256(data) != entry["sha256"]:
        problem = f"{furi}: does not match the manifest (truncated or corrupt)"
        raise CheckpointError(problem, [problem])
    return data


def verify_checkpoint(uri: str) -> list[str]:
    """Problems with the checkpoint directory at ``uri`` (each names the bad file); ``[]`` when
    every file matches the manifest."""
    return _load_verified(uri)[2]


def load_checkpoint(uri: str) -> Checkpoint:
    """Load and verify the checkpoint directory at ``uri``; raise CheckpointError if it is bad."""
    manifest, files, problems = _load_verified(uri)
    if problems or manifest is None:
        raise CheckpointError(f"checkpoint {uri} is unusable: " + "; ".join(problems), problems)
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    return Checkpoint(int(manifest["step"]), name, uri, files, manifest)


def load_latest_checkpoint(
    output_uri: str, only: Only = None, older_than: int | None = None
) -> Checkpoint | None:
    """The newest good checkpoint under ``<output>/checkpoints``, or None if there is none yet.
    ``only``: read and verify just those files of it (e.g. the driver's small state, without the
    trainer state that rank 0 reads itself); the checkpoint's ``files`` then hold only those.
    ``older_than``: only checkpoints of a lower step (the caller found that one untrusted).

    Starts from the one ``latest`` names (or, without a marker, the newest complete one); if it
    is corrupt, truncated or incomplete, warns naming the bad files and tries the previous
    complete checkpoints by step. Raises CheckpointError naming every bad file when checkpoints
    were published but none is usable. Directories without a manifest and never named by
    ``latest`` are unfinished writes and are skipped silently.
    """
    root = checkpoints_uri(output_uri)
    infos = list_checkpoints(output_uri)
    marker = _read_marker(output_uri) if older_than is None else None

    candidates: list[str] = []
    problems: list[str] = []
    below: int | None = older_than
    if marker:
        m = _NAME_RE.match(marker)
        if m is None:
            problems.append(
                f"{storage.join(root, LATEST_MARKER)}: names {marker!r}, not a step dir"
            )
        else:
            below = int(m.group(1))
            if any(i.name == marker for i in infos):
                candidates.append(marker)
            else:
                problems.append(
                    f"{storage.join(root, marker)}: named by {LATEST_MARKER} but missing"
                )
    for info in reversed(infos):
        if info.complete and info.name not in candidates and (below is None or info.step < below):
            candidates.append(info.name)

    for name in candidates:
        uri = storage.join(root, name)
        manifest, files, bad = _load_verified(uri, only)
        if manifest is not None and not bad:
            ckpt = Checkpoint(int(manifest["step"]), name, uri, files, manifest, list(problems))
            if problems:
                logger.warning("falling back to checkpoint %s", uri)
            return ckpt
        for p in bad:
            logger.warning("skipping bad checkpoint %s: %s", name, p)
        problems.extend(bad)

    if not problems:
        return None
    raise CheckpointError(
        f"no usable checkpoint under {root}; every published one is bad:\n  "
        + "\n  ".join(problems)
        + f"\nDelete {root} (or choose another --output) to start from scratch.",
        problems,
    )


def _prune(output_uri: str, step: int, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints up to ``step``; drop older ones, unfinished
    dirs below ``step`` and local temp dirs."""
    root = checkpoints_uri(output_uri)
    marker = _read_marker(output_uri)
    infos = list_checkpoints(output_uri)
    complete = [i for i in infos if i.complete and i.step <= step]
    kept = {i.name for i in complete[-keep:]} | {checkpoint_name(step)}
    if marker:
        kept.add(marker)
    for info in infos:
        if info.name in kept or info.step > step:
            continue
        logger.info("pruning checkpoint %s", info.uri)
        storage.delete_prefix(info.uri)
    if not storage.is_s3(root):
        base = Path(root).expanduser()
        for tmp in base.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)


def json_object(path: Path) -> dict | None:
    """The JSON object in the file at `path`; None when the file is missing or unreadable, is
    not JSON, or holds something other than an object."""
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
