"""Glob patterns in `--data` and `--eval-data`: `data/train-*.jsonl`, `corpus/**/*.parquet`,
`s3://bucket/shards/part-0000[0-4].jsonl.gz`.

A pattern names files, never a directory (on S3 there are none): `data/**` names every file
under `data`. The rule is `glob.glob(pattern, recursive=True)`'s, and `glob_match` applies it to
S3 keys, which `glob` cannot list, so a pattern picks the same files from a directory and from
its copy on S3: `*`, `?` and `[...]` match within one path segment, a `**` segment matches any
number of directories (none included), and a wildcard never matches a name that starts with `.`
unless the pattern's segment does. A path that exists under its own name is never a pattern;
`[[]` matches a literal `[`. Braces are not a pattern (`part-{0,1}.jsonl` is the shell's brace
expansion, which a quoted argument does not get, and glob's rule has none): a path that names
nothing and holds them gets `brace_hint`.
"""

from __future__ import annotations

import fnmatch
import re

GLOB_CHARS = frozenset("*?[")


def has_glob(text: str) -> bool:
    """Whether `text` holds a wildcard (`*`, `?` or `[`)."""
    return any(c in GLOB_CHARS for c in text)


_BRACES = re.compile(r"\{[^{}/]*,[^{}/]*\}")


def brace_hint(text: str) -> str:
    """For an error about `text` that named nothing: what to write instead of the shell's brace
    expansion it holds (`{0,1}`), else ""."""
    found = _BRACES.search(text)
    if found is None:
        return ""
    return (
        f"; {found.group(0)} is the shell's brace expansion, not a pattern here: name the files "
        "with * or [...] (part-[01].jsonl), or give their directory"
    )


def split_glob(pattern: str) -> tuple[str, str]:
    """The pattern's leading segments that hold no wildcard, and the rest:
    `data/raw/**/*.jsonl` → (`data/raw`, `**/*.jsonl`); `*.jsonl` → (``, `*.jsonl`)."""
    parts = pattern.split("/")
    first = next(i for i, part in enumerate(parts) if has_glob(part))
    return "/".join(parts[:first]), "/".join(parts[first:])


def glob_match(pattern: str, relative: str) -> bool:
    """Whether the `/`-separated path `relative` matches `pattern` (both relative to the same
    directory), by glob's rule (see the module's docstring)."""
    return _match(pattern.split("/"), relative.split("/"))


def _match(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # nothing, or one more name (not a hidden one) and try again
        if _match(rest, parts):
            return True
        return bool(parts) and not parts[0].startswith(".") and _match(pattern, parts[1:])
    if not parts:
        return False
    name = parts[0]
    if name.startswith(".") and has_glob(head) and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and _match(rest, parts[1:])
