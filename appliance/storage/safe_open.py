"""Lock and marker files opened without following links: each must be a regular file.

A symlink planted at `OUTPUT/.appliance.lock` (or at a lock in a shared temp dir) would otherwise
be followed, and its target opened, locked and (for the output's lock) truncated; a FIFO there
would block the open. `open_regular` refuses both, naming the file."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


class NotARegularFile(OSError):
    """A lock or marker file that is a symlink, a directory, a FIFO or any other non-regular
    file; its message names it and says what to do."""


def open_regular(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_CREAT…)` that never follows a symlink at `path` and returns only
    a descriptor of a regular file (O_NONBLOCK while opening: a FIFO planted there does not
    hang the open). Raises NotARegularFile, naming `path`, for anything else; other OSErrors
    (no permission, no directory) as os.open raises them."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError:
        if _is_link(path):
            raise _refused(path, "a symbolic link") from None
        if os.path.isdir(path):
            raise _refused(path, "a directory") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refused(path, "not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _is_link(path: str | Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _refused(path: str | Path, what: str) -> NotARegularFile:
    return NotARegularFile(
        f"{path} is {what}: appliance opens its lock and marker files only as regular files, "
        f"never through a link; remove it (rm {path}) and run again"
    )
