"""CSV and TSV data files: a header row names the columns, and each row after it is a record
whose keys are those names (`text`; `prompt`, `completion`; `instruction`, `input`, `output`),
every value a string, as `datasets`' csv loader reads them (a cell left empty is the empty
string; a row shorter than the header has no value, null, in its last columns). A `.csv` is
comma-separated, a `.tsv` tab-separated; both are read with Python's `csv` module (quoted cells
may hold the separator, quotes doubled, and line breaks), compressed like JSON Lines or not. A row
is named in errors by the line it ends on (`file:line`)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from appliance.errors import DataError

DELIMITED = {"csv": ",", "tsv": "\t"}

#: a cell past this many characters is an error naming its line (the csv module's default,
#: 128 KiB, is smaller than many documents)
MAX_CELL_CHARS = 16 << 20


def delimited_rows(raw: BinaryIO, path: Path, kind: str) -> Iterator[tuple[int, dict]]:
    """(the line the row ends on, {column: value}) for each row after the header of the CSV
    (`kind` "csv") or TSV ("tsv") file `path`, open as `raw` (decompressed bytes). DataError
    naming `path` and the line for a file that is not CSV (a NUL byte, a cell past
    MAX_CELL_CHARS), one that is not UTF-8, or a row with more cells than the header."""
    csv.field_size_limit(MAX_CELL_CHARS)
    line = 0
    sep = DELIMITED[kind]
    try:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
        reader = csv.DictReader(text, delimiter=sep)
        for row in reader:
            line = reader.line_num
            if None in row:  # DictReader's key for the cells past the header's
                header = len(reader.fieldnames or ())
                raise DataError(
                    f"{path}:{line}: the row has {header + len(row[None])} cells, the header "
                    f"{header}: quote a cell that holds the separator ({sep!r})"
                )
            yield line, row
    except csv.Error as e:
        raise DataError(f"{path}:{line + 1}: not {kind.upper()}: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason}, after line {line})") from None
