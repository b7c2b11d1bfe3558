"""User-facing errors: each says what is wrong, what was found, and what to do next.

The CLI prints them as one line and exits 1 without a traceback. They are plain exceptions with a
single message argument, so they pickle across Ray actor boundaries unchanged.
"""

from __future__ import annotations

from typing import Any


class ApplianceError(Exception):
    """Base class for errors caused by the user's input, not by a bug: bad config (ConfigError),
    model (ModelError), data (DataError), storage (StorageError) or checkpoints
    (checkpoints.CheckpointError). The CLI prints these; anything else is a bug and keeps its
    traceback."""


class ConfigError(ApplianceError):
    """A bad flag or config-file key; the message names it (every problem, one per line)."""


class ModelError(ApplianceError):
    """A model directory that cannot be used: missing files, unsupported architecture, bad shapes."""


class DataError(ApplianceError):
    """A problem with the dataset or tokenizer that the user must fix; the message names it.

    Takes exactly one message argument so that it pickles (and so crosses Ray actor boundaries)
    unchanged.
    """


class TrainingError(ApplianceError):
    """Training that went wrong in a way no restart mends: a loss that is not finite."""


# Error kinds carried by StorageError.kind, for callers that branch on them.
NOT_FOUND = "not_found"
NO_BUCKET = "no_bucket"
ACCESS_DENIED = "access_denied"
NO_CREDENTIALS = "no_credentials"
NO_SPACE = "no_space"
INVALID = "invalid"
OTHER = "other"


class StorageError(ApplianceError):
    """A storage operation failed. ``uri`` names the object; ``kind`` is one of the
    error-kind constants above (``NOT_FOUND``, ``NO_BUCKET``, ``ACCESS_DENIED``, ...)."""

    def __init__(self, message: str, uri: str | None = None, kind: str = OTHER) -> None:
        super().__init__(message)
        self.uri = uri
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across Ray processes
        return (type(self), (str(self), self.uri, self.kind))


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message (its type's name when it has none): for one-line errors
    that quote what a library raised."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def cause_chain(e: BaseException) -> list[BaseException]:
    """The exception and what it wraps, outermost first (Ray nests an actor's failure in
    `.cause`, a task's in `.cause` again when it crosses another actor)."""
    chain = [e]
    while isinstance(getattr(chain[-1], "cause", None), BaseException) and len(chain) < 10:
        chain.append(chain[-1].cause)  # type: ignore[attr-defined]
    return chain


def type_name(value: Any) -> str:
    """How an error names a value's type: JSON's words, and a table column's Python type."""
    if value is None:
        return "null"
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    names |= {int: "a number", float: "a number", bytes: "bytes (a binary column)"}
    return names.get(type(value), f"a {type(value).__name__} value")


def appliance_command() -> str:
    """`appliance` as the user can type it again, for the commands hints print: `appliance`
    when that is on the PATH (or the process is not the command line: tests, a notebook), else
    the script as it was started (`.venv/bin/appliance`), or `PYTHON -m appliance` for
    `python -m appliance` when no `appliance` is on the PATH."""
    import os
    import shutil
    import sys

    argv0 = sys.argv[0] if sys.argv else ""
    script = os.path.basename(argv0) == "appliance"
    module = argv0.endswith(os.path.join("appliance", "__main__.py"))
    if not (script or module):
        return "appliance"
    found = shutil.which("appliance")
    if found and (not script or _same_file(found, argv0)):
        return "appliance"
    if script:
        return _as_typed(argv0)
    python = shutil.which("python")
    python = "python" if python and _same_file(python, sys.executable) else sys.executable
    return f"{_as_typed(python)} -m appliance"


def _same_file(a: str, b: str) -> bool:
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _as_typed(path: str) -> str:
    """`path` relative to the working directory when it is under it (`.venv/bin/appliance`)."""
    import os

    full = os.path.abspath(path)
    here = os.getcwd()
    if full.startswith(here + os.sep):
        return os.path.relpath(full, here)
    return full
