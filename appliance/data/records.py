"""Shard reading, record parsing, tokenization and the batch type. Pure Python: no Ray here.

A dataset (`listing.py`: which files; `files.py`: each format read as what documents) is numbered in
document order over its files. Worker `w` of `N` owns the documents whose global index `% N ==
w`; its documents are numbered 0, 1, ... within its shard, and the cursor (see
`tokenize_worker.py`) refers to those shard indices.

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

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from appliance.data.chat import (
    ChatError,
    ChatTemplate,
    FieldMap,
    messages_of,
    render_with_spans,
    target_mask,
    tools_of,
)
from appliance.data.delimited import DELIMITED
from appliance.data.files import (
    MAX_LINE_BYTES,
    TABLES,
    data_format,
    delimited_rows,
    is_json_array,
    json_array_items,
    read_chunks,
    read_lines,
    table_num_rows,
    table_rows,
)
from appliance.data.listing import find_data_files
from appliance.data.templates import NAMED_TEMPLATES
from appliance.errors import DataError, type_name

ON_BAD_RECORD = ("fail", "skip")


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
    # the first record this worker cut (Record.cut), on the batch after it: the driver says it once
    cut_note: str | None = None


@dataclass(frozen=True)
class Record:
    """A parsed document: `text`, or `prompt` + `completion` (then `text` is None), or a
    conversation: `messages` (and the record's `tools`, for the template), rendered into `text`
    with `spans` (the trained assistant turns' characters, see chat.py) once a chat template is
    applied."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    spans: tuple[tuple[int, int], ...] | None = None
    cut: str | None = None  # what of the record was cut to keep memory bounded (cut_record)


#: a record's text (each of prompt and completion; a conversation's rendering) past this many
#: characters is cut: the tokenizer's memory grows about 100 bytes a character (a 16 MB line
#: took 1.8 GB), and 1 Mi characters are some 250k tokens, more than any row holds
MAX_RECORD_CHARS = 1 << 20
MAX_TXT_BYTES = 4 * MAX_RECORD_CHARS  # of a .txt document: UTF-8's longest characters
CUT_ADVICE = (
    "appliance reads at most {chars:,} characters of one record (and lines of at most "
    "{line:,} bytes), so that memory stays bounded: split long documents into several records "
    "to train on all of them (said once: later records cut alike are not named)"
)


def cut_record(record: Record, where: str) -> Record:
    """`record` with its text (or prompt and completion) cut to MAX_RECORD_CHARS, saying so in
    its `cut`; a conversation's spans end at the cut. The record itself when nothing is over."""
    import dataclasses

    fields = {k: getattr(record, k) for k in ("text", "prompt", "completion")}
    over = {k: len(v) for k, v in fields.items() if v is not None and len(v) > MAX_RECORD_CHARS}
    if not over:
        return record
    cut = {k: fields[k][:MAX_RECORD_CHARS] for k in over}
    if record.spans is not None:
        spans = tuple(
            (a, min(b, MAX_RECORD_CHARS)) for a, b in record.spans if a < MAX_RECORD_CHARS
        )
        cut["spans"] = spans
    said = ", ".join(
        f"{k} cut to {MAX_RECORD_CHARS:,} of its {n:,} characters" for k, n in over.items()
    )
    return dataclasses.replace(record, **cut, cut=cut_note(where, said))


def cut_note(where: str, said: str) -> str:
    """What was cut of the record at `where` (`said`), and why and what to do."""
    return f"{where}: {said}; " + CUT_ADVICE.format(chars=MAX_RECORD_CHARS, line=MAX_LINE_BYTES)


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
    data: Any  # bytes ("jsonl", "txt"), or the value itself ("object": a table's row as a dict,
    # or a .json array's item): never turned back into JSON, so a column
    # JSON cannot hold (a date, bytes) is only a problem if the record's text is in it
    kind: str  # "jsonl" | "txt" | "object"


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
            if data_format(f) in TABLES:  # decode a table only if it holds one of this shard's
                n = table_num_rows(f)
                if not any(self._mine(i, first) for i in range(g, g + n)):
                    g += n
                    self.total_documents = g
                    continue
            for where, data, kind in file_documents(f):
                if self._mine(g, first):
                    yield RawDocument(g // self.num_workers, where, document_data(data), kind)
                g += 1
                self.total_documents = g


def file_documents(f: Path) -> Iterator[tuple[str, Any, str]]:
    """Every document of one data file, in order: (where, data, kind) as RawDocument holds them,
    but a .txt file's data is its path (`document_data` reads it: only a document that is read
    is)."""
    kind = data_format(f)
    if kind == "txt":
        yield str(f), f, "txt"
    elif kind in TABLES:
        for row, obj in enumerate(table_rows(f)):
            yield f"{f}:row {row}", obj, "object"
    elif kind in DELIMITED:
        for line, obj in delimited_rows(f):
            yield f"{f}:{line}", obj, "object"
    elif kind == "json" and is_json_array(f):
        for i, obj in enumerate(json_array_items(f)):
            yield f"{f}:[{i}]", obj, "object"
    else:
        for lineno, line in enumerate(read_lines(f, MAX_LINE_BYTES), 1):
            if isinstance(line, int):  # too long to hold: its length, the record left out
                yield f"{f}:{lineno}", line, "oversize"
            elif line.strip():  # blank lines are not documents
                yield f"{f}:{lineno}", line, "jsonl"


def document_data(data: Any) -> Any:
    """A document's data from `file_documents`: a .txt file's path read (`_head`)."""
    return _head(data) if isinstance(data, Path) else data


def _head(path: Path) -> bytes:
    """A .txt document: the whole file, or its first MAX_TXT_BYTES and a byte past them (so
    that parse_document knows it was cut), never more."""
    out, size = [], 0
    for chunk in read_chunks(path, 1 << 20):
        out.append(chunk[: MAX_TXT_BYTES + 1 - size])
        size += len(out[-1])
        if size > MAX_TXT_BYTES:
            break
    return b"".join(out)


def _decode_utf8(data: bytes, where: str) -> str:
    try:
        # utf-8-sig: drop a byte-order mark that Windows editors put at the start of a file.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _json_line(text: str, where: str) -> Any:
    """A .jsonl line's value; BadRecord naming `where` and the column when it is not JSON."""
    try:
        # without its line break, or a line cut short is reported at the next line's column 1
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        # json's C scanner says "Invalid control character at": one "at" is enough
        problem = f"{e.msg.removesuffix(' at')} at column {e.colno}"
        if e.msg.startswith("Invalid control character"):
            problem += " (a tab or other control character inside a string must be escaped: \\t)"
        raise BadRecord(f"{where}: malformed JSON: {problem}") from None


def parse_document(
    raw: RawDocument, chat: ChatTemplate | None = None, fields: FieldMap | None = None
) -> Record:
    """Decode and validate one document; DataError naming `file:line` (or file) if it is bad.

    A conversation (and an Alpaca record, `alpaca_messages`) is rendered with `chat` (the
    model's template, or --chat-template's) into `text` + `spans`; without a template it is an
    error that says to pass --chat-template. `fields`: where a conversation of another shape
    keeps its messages, roles and contents (chat.FieldMap)."""
    if raw.kind == "oversize":  # a line too long to hold: left out, said once
        said = f"a line of {raw.data:,} bytes (over {MAX_LINE_BYTES:,}) is left out"
        return Record(text="", cut=cut_note(raw.where, said))
    if raw.kind == "object":
        obj = raw.data
    else:
        if raw.kind == "txt" and len(raw.data) > MAX_TXT_BYTES:  # cut at a character's start
            text = raw.data[:MAX_TXT_BYTES].decode("utf-8-sig", errors="ignore")[:MAX_RECORD_CHARS]
            said = f"text cut to {len(text):,} characters (the file: over {MAX_TXT_BYTES:,} bytes)"
            return Record(text=text, cut=cut_note(raw.where, said))
        text = _decode_utf8(raw.data, raw.where)
        if raw.kind == "txt":
            return cut_record(Record(text=text), raw.where)
        obj = _json_line(text, raw.where)
    if not isinstance(obj, dict):
        raise BadRecord(f"{raw.where}: expected a JSON object, found {type_name(obj)}")
    # a null is a key left out: a table's column where this row has no value, or what
    # `datasets`' to_json writes for it ({"text": null, "messages": [...]} is a chat record)
    nulls = sorted(k for k, v in obj.items() if v is None)
    obj = {k: v for k, v in obj.items() if v is not None}
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise BadRecord(f'{raw.where}: "text" must be a string, found {type_name(obj["text"])}')
        return cut_record(Record(text=obj["text"]), raw.where)
    if "prompt" in obj and "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj[key], str):
                raise BadRecord(
                    f'{raw.where}: "{key}" must be a string, found {type_name(obj[key])}'
                )
        return cut_record(Record(prompt=obj["prompt"], completion=obj["completion"]), raw.where)
    try:
        messages = messages_of(obj, raw.where, fields)
        if messages is None:
            messages = alpaca_messages(obj, raw.where)
        if messages is not None:
            if chat is None:
                raise DataError(
                    f"{raw.where}: a chat record, but the tokenizer has no chat template "
                    "(no chat_template in tokenizer_config.json, no chat_template.jinja): "
                    f"pass --chat-template NAME ({', '.join(NAMED_TEMPLATES)}) or FILE"
                )
            tools = tools_of(obj, raw.where)
            text, spans = render_with_spans(chat, messages, raw.where, tools)
            record = Record(text=text, messages=messages, tools=tools, spans=tuple(spans))
            return cut_record(record, raw.where)
    except ChatError as e:
        raise BadRecord(str(e)) from None
    keys = sorted(obj)
    shown = _names(keys) or "none"
    if nulls:
        shown += f"; null: {_names(nulls)}"
    wanted = '"prompt" + "completion", "messages", "conversations"'
    if fields is not None and fields.messages is not None:
        wanted += f', --field-messages "{fields.messages}"'
    hint = ""
    listed = [
        k for k in keys if isinstance(obj[k], list) and obj[k] and isinstance(obj[k][0], dict)
    ]
    if listed and (fields is None or fields.messages is None):  # a conversation, under its name?
        hint = f" (a conversation under {json.dumps(listed[0])}? --field-messages {listed[0]})"
    raise BadRecord(f'{raw.where}: record has no "text" (nor {wanted}); keys found: {shown}{hint}')


ALPACA_KEYS = ("instruction", "input", "output", "system")


def alpaca_messages(obj: dict, where: str) -> list[dict] | None:
    """An Alpaca record's conversation, or None when `obj` is not one: `{"instruction": ...,
    "input": ..., "output": ...}` (`input` and `system` optional) is the user turn `instruction`,
    then a line break and `input` when it is not empty, and the assistant turn `output`, after a
    system turn `system` when given (LLaMA-Factory's reading). Rendered with the chat template
    like any conversation, so the prompt's wording is the template's. ChatError naming `where`
    and the key when a value is not a string."""
    if "instruction" not in obj or "output" not in obj:
        return None
    for key in ALPACA_KEYS:
        if key in obj and not isinstance(obj[key], str):
            raise ChatError(f'{where}: "{key}" must be a string, found {type_name(obj[key])}')
    user = obj["instruction"]
    if obj.get("input"):
        user += "\n" + obj["input"]
    messages = [{"role": "system", "content": obj["system"]}] if obj.get("system") else []
    return [
        *messages,
        {"role": "user", "content": user},
        {"role": "assistant", "content": obj["output"]},
    ]


def _names(keys: list[str]) -> str:
    """Up to ten keys, quoted and comma-separated."""
    return ", ".join(json.dumps(k) for k in keys[:10]) + (", ..." if len(keys) > 10 else "")


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

    The mask is False on prompt tokens: those are never targets. An empty or blank text gives no
    tokens (packing and evaluation drop a document under 2 tokens). A conversation's rendered text
    is encoded without special tokens (the template places them); its mask is chat.target_mask.
    """
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets needed
    text_idx = [i for i, r in enumerate(records) if r.text is not None and r.spans is None]
    # An empty (or blank) text is no document: no tokens at all, not BOS + EOS, which would teach
    # the model to stop at once (wikitext-style data holds thousands of empty rows).
    empty = {i for i in text_idx if not records[i].text.strip()}  # type: ignore[union-attr]
    text_idx = [i for i in text_idx if i not in empty]
    pc_idx = [i for i, r in enumerate(records) if r.text is None]
    chat_idx = [i for i, r in enumerate(records) if r.spans is not None]
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(records)
    for i in empty:
        out[i] = (np.empty(0, dtype=np.int64), np.empty(0, dtype=bool))
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
    fields: FieldMap | None = None,
) -> None:
    """DataError unless some document of the training data has a target token (a token after
    its first that is trained on). Reads until it finds one: the first chunk, for any normal
    dataset; only a dataset with nothing to learn is read to the end, and refused before training
    starts. A bad record fails here as it would in a worker, unless `on_bad_record="skip"`.
    `tokenizer`: the one `load_tokenizer` (or `check_tokenizer_fits`) returned. `fields`: as
    parse_document's."""
    records: list[Record] = []
    reader = iter(ShardReader(find_data_files(data_path), 0, 1, holdout=holdout))
    read, bad = 0, []  # documents read; the bad ones' errors
    while True:
        raw = next(reader, None)
        if raw is not None:
            read += 1
            try:
                records.append(parse_document(raw, chat, fields))
            except DataError as e:
                if on_bad_record != "skip":
                    raise with_skip_hint(e) from None
                bad.append(str(e))
        if records and (raw is None or len(records) == chunk):
            if any(mask[1:].any() for _, mask in encode_records(tokenizer, records, eos_id)):
                return
            records = []
        if raw is None:
            break
    if read == 0 and holdout is not None:  # (find_data_files found documents)
        raise DataError(
            f"{data_path}: --eval-split {holdout.fraction} holds out every document, so there is "
            "nothing to train on: give a smaller --eval-split"
        )
    if bad and len(bad) == read:
        raise DataError(
            f"{data_path}: every record ({read}) is bad, and --on-bad-record skip skipped them "
            f"all, so there is nothing to learn; the first: {bad[0]}"
        )
    raise DataError(
        f"{data_path}: no record has a target token, so there is nothing to learn "
        "(completions, assistant turns: check the records and the chat template)"
    )
