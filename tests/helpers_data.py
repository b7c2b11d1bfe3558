"""Dataset files for the tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list, blank_lines: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    if blank_lines:
        lines = [x for line in lines for x in (line, "   ")]
    path.write_text("\n".join(lines) + "\n")
    return path


def sentences_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    """`n` of the test tokenizer's sentences (tests/helpers_tokenizer.py), one {"text": ...}
    record a line, written to `path`."""
    from tests.helpers_tokenizer import sentences

    return write_jsonl(path, [{"text": s} for s in sentences(n, seed=seed)])
