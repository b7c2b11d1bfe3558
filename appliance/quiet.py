"""stdout and stderr that go quiet when whoever read them is gone.

`appliance train … 2>&1 | tee train.log`, then Ctrl-C in that terminal: the signal ends `tee`
too, and the run's next write to the dead pipe raised BrokenPipeError, which failed the run
before its checkpoint. A graceful stop must not depend on the output being read: once a write
to stdout or stderr finds its pipe dead, that descriptor is pointed at /dev/null (every later
write to it, Python's, Ray's or a C library's, succeeds and goes nowhere) and the write is
dropped. `install()` wraps sys.stdout and sys.stderr so; the `appliance` executable calls it
first thing."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

#: the errors that say the reader of a pipe or socket is gone
_GONE = (errno.EPIPE, errno.ECONNRESET)
_quiet: set[int] = set()  # the descriptors pointed at /dev/null


def is_dead_pipe(e: BaseException) -> bool:
    """Whether `e` is a write to a pipe (or socket) whose reader is gone."""
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno in _GONE)


def silence(fd: int) -> None:
    """Point `fd` at /dev/null, for good: what is written to it from now on goes nowhere."""
    if fd in _quiet:
        return
    _quiet.add(fd)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def is_quiet(fd: int) -> bool:
    return fd in _quiet


def write_fd(fd: int, data: bytes) -> None:
    """os.write to `fd` that never raises for a dead reader (it goes quiet instead) nor for any
    other OSError: for a signal handler, which must not raise into whatever it interrupted."""
    try:
        os.write(fd, data)
    except OSError as e:
        if is_dead_pipe(e):
            silence(fd)


class _Quiet:
    """A stream (text or binary) whose writes and flushes go quiet on a dead pipe; everything
    else is the wrapped stream's."""

    def __init__(self, stream: Any, fd: int):
        self._stream = stream
        self._fd = fd

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as e:
            if not is_dead_pipe(e):
                raise
            silence(self._fd)
            try:  # what is buffered now drains into /dev/null
                self._stream.flush()
            except OSError:
                pass
            return None

    def write(self, data: Any) -> int:
        self._guard(self._stream.write, data)
        return len(data)

    def writelines(self, lines: Any) -> None:
        self._guard(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    @property
    def buffer(self) -> Any:  # click and others write bytes to it
        return _Quiet(self._stream.buffer, self._fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def install() -> None:
    """Wrap sys.stdout and sys.stderr (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _Quiet):
            continue
        try:
            fd = stream.fileno()
        except (OSError, ValueError, AttributeError):
            continue
        setattr(sys, name, _Quiet(stream, fd))
