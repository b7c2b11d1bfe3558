"""The scratch directories an export writes in, and the cleaning of those a dead one left.

`appliance export` writes the merged model into a scratch directory (beside a local --output,
renamed into place when complete; under the S3 cache for an s3:// one, then uploaded). A
SIGKILLed export left it behind, as big as the merged model, and nothing removed it. Now each
scratch directory has a sibling lock file (`NAME.lock`) that its export holds an flock on for as
long as it runs; the kernel lets go when the process dies, however it dies. The next export
(`clean_dead`, in the same parent directory) removes every scratch directory whose lock it can
take, and never one whose lock is held: a live export's. A scratch directory of an export from
before the lock files is judged by the pid in its name, on this host."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from appliance.storage.safe_open import open_regular

#: `.NAME.partial-PID-HEX` (beside a local --output) or `.export-PID-HEX` (under the S3 cache)
_SCRATCH = re.compile(r"^\.(?:.+\.partial|export)-(\d+)-[0-9a-f]{8}$")
LOCK = ".lock"


@contextlib.contextmanager
def scratch_dir(parent: Path, stem: str) -> Iterator[Path]:
    """A new directory `parent/STEM-PID-HEX`, its lock held while the caller writes in it.
    The caller renames it away or it is removed at the end; the lock file goes last."""
    path = parent / f"{stem}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lock = path.with_name(path.name + LOCK)
    fd = open_regular(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path.mkdir()  # honours the umask
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)  # gone already when renamed into place
    finally:
        lock.unlink(missing_ok=True)  # while still held: a cleaner never finds it free early
        os.close(fd)


def clean_dead(parent: Path) -> list[Path]:
    """Remove the scratch directories in `parent` that dead exports left (their lock free, or,
    without a lock file, their pid gone on this host); the ones removed. Never a live one's."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for path in entries:
        m = _SCRATCH.match(path.name)
        if m is None or path.is_symlink() or not path.is_dir():
            continue
        lock = path.with_name(path.name + LOCK)
        if os.path.lexists(lock):
            try:
                fd = open_regular(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live export writes there
                os.close(fd)
                continue
            try:
                shutil.rmtree(path, ignore_errors=True)
                lock.unlink(missing_ok=True)
            finally:
                os.close(fd)
        elif _alive(int(m.group(1))):
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
