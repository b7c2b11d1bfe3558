"""Dataset reading, record parsing, tokenization and the batch type. Pure Python: no Ray here.

A dataset is a `.jsonl`, `.json`, `.parquet`, `.arrow` or `.txt` file, or a directory searched
recursively for them (sorted by relative path; other files are skipped, and `unreadable_files`
names them). `.jsonl`, `.json` and `.txt` files may be compressed (`.gz`, `.bz2`, `.xz`, `.zst`:
read as they are decompressed, never unpacked to disk). Documents are numbered in that order over
all files: a non-blank `.jsonl` line is one document, a `.json` file is JSON Lines too unless it
holds one JSON array, whose items are the documents (`file:[N]` in errors), a `.parquet` or
`.arrow` row is one document (read with pyarrow, the same columns as the JSON keys, `file:row N` in
errors; `.arrow` is what `datasets` writes: save_to_disk, its cache), a `.txt` file is one
document. Worker `w` of `N` owns the documents whose global index `% N == w`; its documents are
numbered 0, 1, ... within its shard, and the cursor (see `tokenize_worker.py`) refers to those
shard indices.

A record is `{"text": ...}` (loss on every token), `{"prompt": ..., "completion": ...}` (loss on
the completion and the EOS only), or a conversation: `{"messages": [{"role", "content"}, ...]}`
or ShareGPT `{"conversations": [{"from", "value"}, ...]}`, rendered with the model's chat template
and trained on the assistant turns (see `chat.py`; no EOS is appended: the template places the
end-of-turn tokens). With `--eval-split`, documents are held out by `Holdout`. A document's ids are
`encode(text, add_special_tokens=True).ids + [eos_id]`; for prompt + completion,
`encode(prompt, add_special_tokens=True).ids + encode(completion, add_special_tokens=False).ids
+ [eos_id]`.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

from .chat import ChatError, ChatTemplate, messages_of, render_with_spans, target_mask
from .errors import ApplianceError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".txt")
TABLES = ("parquet", "arrow")  # a row is a document, the columns its keys
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # of .jsonl, .json and .txt files (not tables)
DATA_FILES = (
    ".jsonl, .json, .parquet, .arrow or .txt; .jsonl, .json and .txt also .gz, .bz2, .xz or .zst"
)
# JSON files that `datasets` writes beside the data (save_to_disk, push_to_hub): never records
METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")
IGNORE_INDEX = -100  # label of a position without loss (PyTorch cross_entropy's ignore_index)
ON_BAD_RECORD = ("fail", "skip")


class DataError(ApplianceError):
    """A problem with the dataset or tokenizer that the user must fix; the message names it.

    Takes exactly one message argument so that it pickles (and so crosses Ray actor boundaries)
    unchanged.
    """


class BadRecord(DataError):
    """One record that cannot be used (unreadable, malformed, missing its text): what
    `--on-bad-record skip` skips. The message names `file:line` and the problem."""


SKIP_HINT = "fix the record, or pass --on-bad-record skip to skip bad records"
SKIP_EXAMPLES = 5  # bad records that `--on-bad-record skip`'s warning names


def with_skip_hint(e: DataError) -> DataError:
    """`e` as `--on-bad-record fail` reports it: a bad record's message also says how to go on."""
    return DataError(f"{e} ({SKIP_HINT})") if isinstance(e, BadRecord) else e


def skipped_message(total: int, examples: Sequence[str], what: str) -> str:
    """`--on-bad-record skip`'s warning: `total` bad records of `what` were left out; the first
    ones (`examples`, each "file:line: problem") named, one a line."""
    head = f"--on-bad-record skip left out {total} bad record(s) of {what}"
    if not examples:  # (those a resumed run's earlier processes read)
        return f"{head} (--on-bad-record fail stops at the first and names it)"
    shown = "all" if len(examples) >= total else "the first"
    return "\n".join([f"{head}; {shown} {len(examples)}:", *(f"  {e}" for e in examples)])


@dataclass
class Batch:
    """One micro-batch of packed rows from one tokenizer worker.

    `input_ids` and `labels` are (micro_batch_size, seq_len) int64; `labels[b, t]` is the target
    for `input_ids[b, t]` or -100 where there is no loss (prompt tokens, padding).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    cursor: dict[str, Any]  # the worker's position AFTER this batch: resume from here
    worker: int  # index of the worker that made it
    pid: int  # os.getpid() of the process that tokenized it
    epoch: int  # epoch its rows belong to (a batch never spans two epochs)
    n_tokens: int  # target tokens, i.e. labels != -100
    skipped_records: int  # bad records this worker skipped so far, each counted once per run
    # --packing documents: (micro_batch_size, seq_len) int64 RoPE positions (restarting at each
    # document) and document ids within each row (-1 on padding); None with --packing stream
    positions: np.ndarray | None = None
    segments: np.ndarray | None = None


@dataclass(frozen=True)
class Record:
    """A parsed document: `text`, or `prompt` + `completion` (then `text` is None), or a
    conversation: `messages`, rendered into `text` with `spans` (the assistant turns' characters,
    see chat.py) once a chat template is applied."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: list[dict] | None = None
    spans: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class Holdout:
    """`--eval-split`: each document (by its global index) is held out with probability
    `fraction`, decided by a hash of (seed, index) so every process agrees. Training readers skip
    held-out documents (`held_out=False`); the evaluation reader yields only them."""

    fraction: float
    seed: int
    held_out: bool = False

    def wants(self, g: int) -> bool:
        key = f"{self.seed}:{g}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return (h < self.fraction * 2**64) == self.held_out


@dataclass(frozen=True)
class RawDocument:
    """A shard document before parsing: its bytes and where it came from."""

    doc: int  # index within the worker's shard
    where: str  # "file:line" for .jsonl, "file:[N]" for a .json array, "file:row N" for a table,
    # "file" for .txt
    data: bytes  # a table's row (null columns dropped) or an array's item arrives as JSON
    kind: str  # "jsonl" | "txt"


def data_format(path: Path) -> str | None:
    """What a file under `--data` holds, from its name: "jsonl", "json", "parquet", "arrow" or
    "txt" (a compressed one by the suffix before its compression's: `a.jsonl.gz` is "jsonl"), or
    None for a file that is not data (`.csv`, `README.md`, `datasets`' metadata JSON)."""
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


def _read_lines(path: Path) -> Iterator[bytes]:
    """The lines of a data file, decompressed; a file that cannot be read or decompressed (a
    truncated download, another format under the suffix) is a DataError naming it."""
    try:
        with open_data(path) as fh:
            yield from fh
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        # an OSError with an errno is the file system's (permission, ...); the others, the data's
        hint = " (a damaged or truncated file?)" if getattr(e, "errno", None) is None else ""
        raise DataError(f"{path}: cannot read: {e}{hint}") from None


def _read_all(path: Path) -> bytes:
    return b"".join(_read_lines(path))


def json_array(path: Path) -> list | None:
    """The items of a `.json` file that holds one JSON array (the whole file is parsed), None
    for JSON Lines. DataError naming the line and column for a file that starts with `[` but is
    not valid JSON, and for one whose first line is not JSON (one JSON object over many lines,
    as an editor writes it: not a dataset either way)."""
    lines = enumerate(_read_lines(path), 1)  # the first non-blank one, after a byte-order mark
    lineno, first = next(
        ((n, t) for n, line in lines if (t := line.removeprefix(b"\xef\xbb\xbf").strip())),
        (0, b""),
    )
    if not first:
        return None  # empty: no documents
    if first.startswith(b"["):
        try:
            items = json.loads(_read_all(path).decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: malformed JSON array: {e.msg} at line {e.lineno} column {e.colno}"
            ) from None
        return items
    try:
        json.loads(first.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno}): a .json dataset is JSON "
            "Lines (one record a line) or one JSON array of records"
        ) from None
    return None


def find_data_files(path: str | Path) -> list[Path]:
    """The dataset's files in document order.

    DataError if the path is missing, holds no data file (`data_format`), or no document at all.
    """
    root = Path(path)
    if not root.exists():
        raise DataError(f"dataset not found: {path}")
    if root.is_file():
        if data_format(root) is None:
            raise DataError(f"unsupported dataset file {path}: expected a data file ({DATA_FILES})")
        files = [root]
    else:
        files = _files_under(root)
        if not files:
            skipped = unreadable_files(root)
            raise DataError(
                f"empty dataset: no data files ({DATA_FILES}) under {path}"
                + (f" (skipped {len(skipped)} other file(s): {_some(skipped)})" if skipped else "")
            )
    if not has_documents(files):
        raise DataError(
            f"empty dataset: no documents in {path} ({len(files)} file(s), all empty or blank)"
        )
    return files


def _some(names: list[str], n: int = 5) -> str:
    """The first `n` of `names`, comma-separated, "..." after them if there are more."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _files_under(root: Path) -> list[Path]:
    """The data files under a directory, sorted by relative POSIX path: the document order is
    the same on every machine."""
    files = [f for f in root.rglob("*") if data_format(f) is not None and f.is_file()]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def unreadable_files(path: str | Path) -> list[str]:
    """Files under a dataset directory that are not data (`.csv`, ...): skipped, and said so."""
    root = Path(path)
    if not root.is_dir():
        return []
    return sorted(
        f.relative_to(root).as_posix()
        for f in root.rglob("*")
        if f.is_file() and data_format(f) is None and not f.name.startswith(".")
    )


# the words that name a split in a file's path, as `datasets` infers splits from file names
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}


def split_of(relative: str) -> str | None:
    """The split a data file's path names (`data/test-00000-of-00001.parquet`: "test"), if any."""
    words = set(re.split(r"[-._ /]", relative.lower()))
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def dataset_notes(path: str | Path, flag: str, uri: str) -> list[str]:
    """What to tell the user about a dataset directory (`path`, the local copy of `uri`, given
    as `flag`) before a run reads it: the files skipped as not data, and files named for several
    splits, every one of which is read (a dataset downloaded from the Hub holds its test split
    beside its train split)."""
    root = Path(path)
    if not root.is_dir():
        return []
    notes = []
    if skipped := unreadable_files(root):
        notes.append(
            f"{flag} {uri}: skipped {len(skipped)} file(s) that are not data ({DATA_FILES}): "
            + _some(skipped)
        )
    files = [f.relative_to(root).as_posix() for f in _files_under(root)]
    splits: dict[str, list[str]] = {}
    for f in files:
        if (split := split_of(f)) is not None:
            splits.setdefault(split, []).append(f)
    if len(splits) > 1:
        named = "; ".join(  # train, validation, test
            f"{len(splits[split])} {split}: {_some(splits[split], 1)}"
            for split in SPLIT_WORDS
            if split in splits
        )
        notes.append(
            f"{flag} {uri}: its {len(files)} files are named for several splits ({named}), and "
            f"every one is read: to use one split, give {flag} that split's file or a directory "
            "of its files alone"
        )
    return notes


def not_held_out_notes(data: str | Path, eval_data: str | Path, eval_uri: str) -> list[str]:
    """A note when `eval_data` (given as `--eval-data eval_uri`) shares files with `data` (the
    same file, however reached): a validation loss over documents the run trains on is not a
    held-out loss."""

    def files(path: Path) -> set[Path]:
        found = [path] if path.is_file() else _files_under(path) if path.is_dir() else []
        return {f.resolve() for f in found if data_format(f) is not None}

    shared = sorted(files(Path(data)) & files(Path(eval_data)))
    if not shared:
        return []
    return [
        f"--eval-data {eval_uri}: {len(shared)} of its files are --data's too, so its loss is "
        f"not held out ({_some([str(f) for f in shared], 3)}): give files the run does not train "
        "on, or --eval-split"
    ]


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
    """Each row of a .parquet or .arrow file as a dict, columns whose value is null left out."""
    for batch in _record_batches(f):
        for row in batch.to_pylist():
            yield {k: v for k, v in row.items() if v is not None}


def table_num_rows(f: Path) -> int:
    """Rows in a .parquet file (from its footer) or an .arrow file (its batches' lengths)."""
    if data_format(f) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(f).metadata.num_rows
        except (OSError, ValueError) as e:
            raise DataError(f"{f}: cannot read as parquet: {e}") from None
    return sum(batch.num_rows for batch in _record_batches(f))


def has_documents(files: Sequence[Path]) -> bool:
    """True as soon as one document is found (cheap: stops at the first)."""
    for f in files:
        kind = data_format(f)
        if kind == "txt":
            return True
        if kind in TABLES:
            if table_num_rows(f) > 0:
                return True
            continue
        if kind == "json" and (items := json_array(f)) is not None:
            if items:
                return True
            continue
        if any(line.strip() for line in _read_lines(f)):
            return True
    return False


class ShardReader:
    """Iterates over one worker's documents, in order, from shard index `start_doc`.

    Documents of other workers are only counted, never decoded. After a full pass,
    `total_documents` is the number of documents in the whole dataset.
    """

    def __init__(
        self,
        files: Sequence[Path],
        worker_index: int,
        num_workers: int,
        start_doc: int = 0,
        holdout: Holdout | None = None,
    ):
        self.files = list(files)
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.start_doc = start_doc
        self.holdout = holdout  # held-out documents keep their index: shards do not move
        self.total_documents = 0

    def _mine(self, g: int, first: int) -> bool:
        if g < first or g % self.num_workers != self.worker_index:
            return False
        return self.holdout is None or self.holdout.wants(g)

    def __iter__(self) -> Iterator[RawDocument]:
        g = 0  # global document index
        first = self.start_doc * self.num_workers + self.worker_index
        for f in self.files:
            kind = data_format(f)
            if kind == "txt":
                if self._mine(g, first):
                    yield RawDocument(g // self.num_workers, str(f), _read_all(f), "txt")
                g += 1
                self.total_documents = g
                continue
            if kind in TABLES:
                n = table_num_rows(f)
                # decode the file only if it holds one of this shard's documents
                if any(self._mine(i, first) for i in range(g, g + n)):
                    for row, obj in enumerate(table_rows(f)):
                        if self._mine(g, first):
                            data = json.dumps(obj).encode()
                            yield RawDocument(
                                g // self.num_workers, f"{f}:row {row}", data, "jsonl"
                            )
                        g += 1
                else:
                    g += n
                self.total_documents = g
                continue
            if kind == "json" and (items := json_array(f)) is not None:
                for i, obj in enumerate(items):
                    if self._mine(g, first):
                        data = json.dumps(obj).encode()
                        yield RawDocument(g // self.num_workers, f"{f}:[{i}]", data, "jsonl")
                    g += 1
                self.total_documents = g
                continue
            for lineno, line in enumerate(_read_lines(f), 1):
                if not line.strip():
                    continue  # blank lines are not documents
                if self._mine(g, first):
                    yield RawDocument(g // self.num_workers, f"{f}:{lineno}", line, "jsonl")
                g += 1
                self.total_documents = g


def _decode_utf8(data: bytes, where: str) -> str:
    try:
        # utf-8-sig: drop a byte-order mark that Windows editors put at the start of a file.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else "a number")


def parse_document(raw: RawDocument, chat: ChatTemplate | None = None) -> Record:
    """Decode and validate one document; DataError naming `file:line` (or file) if it is bad.

    A conversation is rendered with `chat` (the model's template) into `text` + `spans`;
    without a template it is an error that says to pass --chat-template."""
    text = _decode_utf8(raw.data, raw.where)
    if raw.kind == "txt":
        return Record(text=text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # json's C scanner says "Invalid control character at": one "at" is enough
        problem = f"{e.msg.removesuffix(' at')} at column {e.colno}"
        if e.msg.startswith("Invalid control character"):
            problem += " (a tab or other control character inside a string must be escaped: \\t)"
        raise BadRecord(f"{raw.where}: malformed JSON: {problem}") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"{raw.where}: expected a JSON object, found {_type_name(obj)}")
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise BadRecord(
                f'{raw.where}: "text" must be a string, found {_type_name(obj["text"])}'
            )
        return Record(text=obj["text"])
    if "prompt" in obj and "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj[key], str):
                raise BadRecord(
                    f'{raw.where}: "{key}" must be a string, found {_type_name(obj[key])}'
                )
        return Record(prompt=obj["prompt"], completion=obj["completion"])
    try:
        messages = messages_of(obj, raw.where)
        if messages is not None:
            if chat is None:
                raise DataError(
                    f"{raw.where}: a chat record, but the tokenizer has no chat template "
                    "(no chat_template in tokenizer_config.json, no chat_template.jinja): "
                    "pass --chat-template FILE"
                )
            text, spans = render_with_spans(chat, messages, raw.where)
            return Record(text=text, messages=messages, spans=tuple(spans))
    except ChatError as e:
        raise BadRecord(str(e)) from None
    keys = sorted(obj)
    shown = ", ".join(json.dumps(k) for k in keys[:10]) + (", ..." if len(keys) > 10 else "")
    hint = ""
    if {"instruction", "output"} <= set(keys):  # Alpaca: its prompt template is the user's to pick
        hint = (
            ' (an Alpaca-style record: write it as "prompt" + "completion", the prompt being '
            'the instruction and input in the template you want, or as "messages")'
        )
    raise BadRecord(
        f'{raw.where}: record has no "text" (nor "prompt" + "completion", "messages", '
        f'"conversations"); keys found: {shown or "none"}{hint}'
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (or a directory holding one) with truncation and padding off."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"tokenizer not found: {p} (expected a tokenizer.json file)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception
        raise DataError(f"cannot load tokenizer {p}: {e}") from None
    # Some tokenizer.json files ship with truncation/padding on; packing needs every token.
    tok.no_truncation()
    tok.no_padding()
    return tok


def check_tokenizer_fits(
    tokenizer_path: str | Path, vocab_size: int, model_dir: str | Path
) -> Tokenizer:
    """The tokenizer, loaded; DataError if it makes ids the model in `model_dir` (config.json's
    `vocab_size`) has no embedding for: a tokenizer of another model. One smaller than the
    model's vocabulary is fine (models often pad theirs)."""
    config_path = Path(model_dir) / "config.json"
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    token, largest = max(vocab.items(), key=lambda item: item[1], default=("", -1))
    if largest >= vocab_size:
        raise DataError(
            f"{tokenizer_path} gives token ids up to {largest} ({token!r}), but {config_path} "
            f"has vocab_size {vocab_size} (ids 0 to {vocab_size - 1}): the tokenizer is not this "
            "model's; use the tokenizer.json that came with the model"
        )
    return tokenizer


def check_dataset(data_path: str | Path) -> list[Path]:
    """Fail fast, in the driver, on a missing or empty dataset (the tokenizer is checked by
    `check_tokenizer_fits`). Returns the data files. Call it before creating workers: a
    DataError raised in an actor's constructor reaches the caller as Ray's ActorDiedError, not
    as DataError."""
    return find_data_files(data_path)


def encode_records(
    tokenizer: Tokenizer, records: Sequence[Record], eos_id: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Encode documents in batches; returns (ids int64, loss mask bool) per record, EOS appended
    (not to a conversation: its template ends each turn itself).

    The mask is False on prompt tokens: those are never targets. A conversation's rendered text
    is encoded without special tokens (the template places them); its mask is chat.target_mask.
    """
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets needed
    text_idx = [i for i, r in enumerate(records) if r.text is not None and r.spans is None]
    pc_idx = [i for i, r in enumerate(records) if r.text is None]
    chat_idx = [i for i, r in enumerate(records) if r.spans is not None]
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(records)
    if chat_idx:
        encs = tokenizer.encode_batch([records[i].text for i in chat_idx], add_special_tokens=False)
        for i, enc in zip(chat_idx, encs, strict=True):
            ids = np.array(enc.ids, dtype=np.int64)
            out[i] = (ids, np.array(target_mask(enc.offsets, records[i].spans), dtype=bool))
    if text_idx:
        encs = encode([records[i].text for i in text_idx], add_special_tokens=True)
        for i, enc in zip(text_idx, encs, strict=True):
            ids = np.array([*enc.ids, eos_id], dtype=np.int64)
            out[i] = (ids, np.ones(len(ids), dtype=bool))
    if pc_idx:
        prompts = encode([records[i].prompt for i in pc_idx], add_special_tokens=True)
        completions = encode([records[i].completion for i in pc_idx], add_special_tokens=False)
        for i, p, c in zip(pc_idx, prompts, completions, strict=True):
            ids = np.array([*p.ids, *c.ids, eos_id], dtype=np.int64)
            mask = np.ones(len(ids), dtype=bool)
            mask[: len(p.ids)] = False
            out[i] = (ids, mask)
    return out  # type: ignore[return-value]


def check_has_targets(
    data_path: str | Path,
    tokenizer: Tokenizer,
    eos_id: int,
    chat: ChatTemplate | None = None,
    holdout: Holdout | None = None,
    on_bad_record: str = "fail",
    chunk: int = 64,
) -> None:
    """DataError unless some document of the training data has a target token (a token after
    its first that is trained on). Reads until it finds one: the first chunk, for any normal
    dataset; only a dataset with nothing to learn is read to the end, and refused before training
    starts. A bad record fails here as it would in a worker, unless `on_bad_record="skip"`.
    `tokenizer`: the one `load_tokenizer` (or `check_tokenizer_fits`) returned."""
    records: list[Record] = []
    reader = iter(ShardReader(find_data_files(data_path), 0, 1, holdout=holdout))
    while True:
        raw = next(reader, None)
        if raw is not None:
            try:
                records.append(parse_document(raw, chat))
            except DataError as e:
                if on_bad_record != "skip":
                    raise with_skip_hint(e) from None
        if records and (raw is None or len(records) == chunk):
            if any(mask[1:].any() for _, mask in encode_records(tokenizer, records, eos_id)):
                return
            records = []
        if raw is None:
            raise DataError(
                f"{data_path}: no record has a target token, so there is nothing to learn "
                "(completions, assistant turns: check the records and the chat template)"
            )
