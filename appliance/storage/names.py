"""Names that come from outside (an S3 key below a prefix, a checkpoint manifest's or a
safetensors index's entry, a path inside a Hugging Face snapshot) are joined to a directory
only once they are known to stay inside it: a key `data/../../.bashrc` under an `s3://` --data
prefix must not be written, or deleted as stale, outside the S3 cache."""

from __future__ import annotations

import os
from pathlib import Path


def why_outside(name: str) -> str | None:
    """Why the relative, '/'-separated `name` could leave the directory it is joined to; None
    when it stays inside. Empty parts and "." are harmless (S3 keys may hold `a//b`)."""
    if not name:
        return "it is empty"
    if "\0" in name:
        return "it holds a NUL byte"
    if name.startswith(("/", "~")) or os.path.isabs(name):
        return "it is an absolute path"
    if ".." in name.split("/"):
        return "it climbs out with '..'"
    return None


def inside(root: Path, name: str) -> Path:
    """`root / name`, checked to stay inside `root`: by its name (why_outside), and by where it
    lands once the links on the way are followed (a link planted in the cache). ValueError,
    saying why, otherwise."""
    why = why_outside(name)
    if why is None:
        real_root = os.path.realpath(root)
        real = os.path.realpath(root / name)
        if os.path.commonpath([real_root, real]) != real_root:
            why = f"it leads to {real}, through a link"
    if why is not None:
        raise ValueError(f"{name!r} would leave {root}: {why}")
    return root / name
