"""Dataset files: which files under `--data` are data, and how each format is read.

A dataset is a `.jsonl`, `.json`, `.parquet`, `.arrow` or `.txt` file, a directory searched
recursively for them (sorted by relative path; other files are skipped, and `unreadable_files`
names them), or a glob pattern naming files (`data/train-*.jsonl`, `data/**`: `globs`; taken in
the same order). `.jsonl`, `.json` and `.txt` files may be compressed (`.gz`, `.bz2`, `.xz`, `.zst`:
read as they are decompressed, never unpacked to disk; `.csv` and `.tsv` too). Documents are numbered in that order over
all files: a non-blank `.jsonl` line is one document, a `.json` file is JSON Lines too unless it
holds one JSON array, whose items are the documents (`file:[N]` in errors; parsed one by one as the
file is read, so an array takes no more memory than JSON Lines), a `.parquet` or `.arrow` row is
one document (read with pyarrow, the same columns as the JSON keys, `file:row N` in errors;
`.arrow` is what `datasets` writes: save_to_disk, its cache), a `.csv` or `.tsv` row after the
header is one document (`delimited.py`, `file:line` in errors), a `.txt` file is one document.
`records.ShardReader` deals them out to the tokenizer workers.

Which files a `--data` names (a directory's listing, a glob, a hub dataset id) and what a run
says about them is `data/listing.py`. Records inside the documents are parsed by
`data/records.py`.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import io
import itertools
import json
import lzma
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from appliance.data import delimited
from appliance.data.delimited import DELIMITED
from appliance.errors import DataError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".txt", ".csv", ".tsv")
TABLES = ("parquet", "arrow")  # a row is a document, the columns its keys
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # of text files (not of parquet or arrow tables)
DATA_FILES = (
    ".jsonl, .json, .parquet, .arrow, .csv, .tsv or .txt; all but .parquet and .arrow also .gz, "
    ".bz2, .xz or .zst"
)
# JSON files that `datasets` writes beside the data (save_to_disk, push_to_hub): never records
METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")


def data_format(path: Path) -> str | None:
    """What a file under `--data` holds, from its name: "jsonl", "json", "parquet", "arrow",
    "csv", "tsv" or "txt" (a compressed one by the suffix before its compression's: `a.jsonl.gz`
    is "jsonl"), or None for a file that is not data (`README.md`, `datasets`' metadata JSON)."""
    name = path.name.lower()
    if name in METADATA_FILES:
        return None
    compressed = name.endswith(COMPRESSIONS)
    if compressed:
        name = name.rsplit(".", 1)[0]
    suffix = Path(name).suffix
    if suffix not in DATA_SUFFIXES or (compressed and suffix[1:] in TABLES):
        return None
    return suffix[1:]


def open_data(path: Path) -> BinaryIO:
    """A data file opened for reading bytes, decompressed on the way as its name says."""
    compression = path.suffix.lower()
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".bz2":
        return bz2.open(path, "rb")
    if compression == ".xz":
        return lzma.open(path, "rb")
    if compression == ".zst":
        import pyarrow as pa  # (the standard library has no zstd before Python 3.14)

        return io.BufferedReader(pa.input_stream(str(path), compression="zstd"))
    return open(path, "rb")  # noqa: SIM115 - the caller closes it (with open_data(...) as fh)


#: a JSON Lines line longer than this is not read into memory: the record is left out (a 256 MB
#: line drove the driver to 23 GB and an OOM kill)
MAX_LINE_BYTES = 16 << 20


def read_lines(path: Path, max_bytes: int | None = None) -> Iterator[bytes | int]:
    """The lines of a data file, decompressed; a file that cannot be read or decompressed (a
    truncated download, another format under the suffix) is a DataError naming it. With
    `max_bytes`, a longer line is read in pieces of that size and dropped: its length (an int)
    stands for it, so no line past `max_bytes` is ever held."""
    with _reading(path) as fh:
        if max_bytes is None:
            yield from fh
            return
        while line := fh.readline(max_bytes + 1):
            if len(line) <= max_bytes or line.endswith(b"\n"):
                yield line
                continue
            size = len(line)
            while (piece := fh.readline(max_bytes)) and not piece.endswith(b"\n"):
                size += len(piece)
            yield size + len(piece)


def read_chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    """A data file, decompressed, in pieces of `size` bytes (errors as read_lines')."""
    with _reading(path) as fh:
        while chunk := fh.read(size):
            yield chunk


def read_all(path: Path) -> bytes:
    return b"".join(read_chunks(path))


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[BinaryIO]:
    """open_data(path), its read and decompression errors as a DataError naming the file."""
    try:
        with open_data(path) as fh:
            yield fh
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        # an OSError with an errno is the file system's (permission, ...); the others, the data's
        hint = " (a damaged or truncated file?)" if getattr(e, "errno", None) is None else ""
        raise DataError(f"{path}: cannot read: {e}{hint}") from None


def is_json_array(path: Path) -> bool:
    """Whether a `.json` file holds one JSON array (its first character, after a byte-order
    mark and blanks, is `[`) rather than JSON Lines. DataError for one whose first line is not
    JSON (one JSON object over many lines, as an editor writes it: not a dataset either way)."""
    for chunk in read_chunks(path, 1 << 16):
        start = chunk.removeprefix(b"\xef\xbb\xbf").lstrip()
        if start:
            if start.startswith(b"["):
                return True
            break
    lines = enumerate(read_lines(path, MAX_LINE_BYTES), 1)  # the first non-blank one
    for lineno, line in lines:
        if isinstance(line, int):  # too long to read: a record, left out when it is read
            break
        if first := line.removeprefix(b"\xef\xbb\xbf").strip():
            try:
                json.loads(first.decode("utf-8", errors="replace"))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno}): a .json dataset "
                    "is JSON Lines (one record a line) or one JSON array of records"
                ) from None
            break
    return False


_BLANKS = re.compile(r"[ \t\n\r]*")


def json_array_items(path: Path, chunk_bytes: int = 1 << 20) -> Iterator[Any]:
    """The items of a `.json` file that holds one JSON array, each parsed as the file is read:
    the memory is an item and a chunk, not the file (each tokenizer worker reads every file).
    DataError naming the line and column where the array is malformed, and the byte where the
    file is not UTF-8."""
    text = _text_chunks(path, chunk_bytes)
    decoder = json.JSONDecoder()
    # the text read and not yet parsed, from `pos`; where buf[0] is: its line, and its column
    # (0-based), for the errors
    buf, pos, line, column = "", 0, 1, 0

    def more() -> bool:  # read on: False at the end of the file
        nonlocal buf, pos, line, column
        chunk = next(text, None)
        if chunk is None:
            return False
        newlines = buf.count("\n", 0, pos)
        line += newlines
        column = pos - buf.rfind("\n", 0, pos) - 1 if newlines else column + pos
        buf, pos = buf[pos:] + chunk, 0
        return True

    def next_char() -> str:  # the next character that is not a blank ("" at the end)
        nonlocal pos
        while (pos := _BLANKS.match(buf, pos).end()) == len(buf) and more():
            pass
        return buf[pos : pos + 1]

    def malformed(problem: str, at: int) -> DataError:  # as json.loads words and places it
        newlines = buf.count("\n", 0, at)
        col = at - buf.rfind("\n", 0, at) if newlines else column + at + 1
        return DataError(
            f"{path}: malformed JSON array: {problem.removesuffix(' at')} at line "
            f"{line + newlines} column {col}"
        )

    if next_char() != "[":
        raise malformed("Expecting '['", pos)
    pos += 1
    if next_char() == "]":
        pos += 1
    else:
        while True:
            next_char()
            while True:  # an item cut by the end of the text read so far is parsed again
                try:
                    item, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if _cut(e, buf) and more():
                        continue
                    raise malformed(e.msg, e.pos) from None
                if end < len(buf) or not more():  # (a number at the end may go on)
                    break
            pos = end
            yield item
            c = next_char()
            if c not in (",", "]"):
                raise malformed("Expecting ',' delimiter", pos)
            pos += 1
            if c == "]":
                break
    if next_char():
        raise malformed("Extra data", pos)


# the most text a cut value leaves after the position its decoding error names: `-Infinit`, the
# `uXXXX` of an escape cut short, a number's `.` or `e`
_CUT_TAIL = 9


def _cut(e: json.JSONDecodeError, buf: str) -> bool:
    """Whether the decoding error `e` of an item in `buf` (the text read so far) may be the end of
    that text cutting the item short: read on and parse it again. A malformed item fails before
    the end, and is named there and then, not after the rest of the file has been read into
    memory. (A string that runs to the end of the text is taken as cut: only the end of the file
    tells.)"""
    return e.msg.startswith("Unterminated string") or len(buf) - e.pos <= _CUT_TAIL


def _text_chunks(path: Path, size: int) -> Iterator[str]:
    """A data file as UTF-8 text (a byte-order mark dropped), in pieces; DataError naming the
    byte where it is not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    done = 0
    for chunk in itertools.chain(read_chunks(path, size), [b""]):  # b"": the end
        try:
            if piece := decoder.decode(chunk, final=not chunk):
                yield piece
        except UnicodeDecodeError as e:
            byte = max(done + e.start - len(decoder.getstate()[0]), 0)
            raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {byte})") from None
        done += len(chunk)


def _record_batches(f: Path) -> Iterator[Any]:
    """The record batches of a .parquet file or an Arrow IPC file (.arrow: the stream format,
    as `datasets`' save_to_disk and cache write it, or the random-access file format),
    memory-mapped; a file pyarrow cannot read is a DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = data_format(f)
    try:
        if kind == "parquet":
            yield from pq.ParquetFile(f).iter_batches(batch_size=1024)
            return
        with pa.memory_map(str(f)) as source:
            if source.read(6) == b"ARROW1":  # the file format's magic number
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            else:
                source.seek(0)
                yield from pa.ipc.open_stream(source)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{f}: cannot read as {kind}: {e}") from None


def table_rows(f: Path) -> Iterator[dict]:
    """Each row of a .parquet or .arrow file as a dict, nulls included (parse_document leaves
    them out, and names them when the row has no text)."""
    for batch in _record_batches(f):
        yield from batch.to_pylist()


def delimited_rows(f: Path) -> Iterator[tuple[int, dict]]:
    """(line, row) of each record of a .csv or .tsv file (`delimited.py`), decompressed."""
    with _reading(f) as fh:
        yield from delimited.delimited_rows(fh, f, data_format(f) or "csv")


def table_num_rows(f: Path) -> int:
    """Rows in a .parquet file (from its footer) or an .arrow file (its batches' lengths)."""
    if data_format(f) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(f).metadata.num_rows
        except (OSError, ValueError) as e:
            raise DataError(f"{f}: cannot read as parquet: {e}") from None
    return sum(batch.num_rows for batch in _record_batches(f))


def count_documents(files: Sequence[Path], limit: int) -> int:
    """The documents in `files`, counted up to `limit` (cheap: reads no further). A .txt file
    is one document; a table's rows are counted from its footer."""
    n = 0
    for f in files:
        kind = data_format(f)
        if kind == "txt":
            n += 1
        elif kind in TABLES:
            n += table_num_rows(f)
        elif kind in DELIMITED:
            n += sum(1 for _ in itertools.islice(delimited_rows(f), limit - n))
        else:
            if kind == "json" and is_json_array(f):
                documents: Iterator = json_array_items(f)
            else:  # JSON Lines: a blank line is no document
                documents = (
                    line
                    for line in read_lines(f, MAX_LINE_BYTES)
                    if isinstance(line, int) or line.strip()
                )
            for _ in documents:
                n += 1
                if n >= limit:
                    break
        if n >= limit:
            return limit
    return n


def has_documents(files: Sequence[Path]) -> bool:
    """True as soon as one document is found (cheap: stops at the first)."""
    return count_documents(files, 1) > 0
