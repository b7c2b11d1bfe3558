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
