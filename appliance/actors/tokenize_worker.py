"""TokenizeWorker: reads one shard of the dataset, tokenizes it and packs it into batches.

A plain class, tested directly; the driver runs it as a Ray actor with
`ray.remote(**ACTOR_OPTIONS)(TokenizeWorker)`.

Packing `documents` (the default, see packing.py): documents are read in groups of about
PACK_GROUP_ROWS rows' worth of tokens; each group is packed by best fit into rows in which a
token attends only to its own document and positions restart at each document (the batch carries
`positions` and `segments`). The cursor is then `{"epoch", "doc", "offset": 0, "row", "packing":
"documents", ...}`: `doc` is the first document of a group, `row` the rows of that group already
returned; a resumed worker re-reads the group and packs it identically.

Packing `stream` (the appliance's first behaviour): the worker concatenates its shard's documents (each ending in EOS) into one stream per
epoch. Row k covers `stream[k*S : k*S + S + 1]`; `input_ids = row[:-1]`, `labels = row[1:]` with
-100 where the target is a prompt token. Consecutive rows overlap by one token, so every stream
token is an input once and a target once (except the first token, never a target). The last row
of an epoch is padded with `pad_id` (labels -100), the last batch of an epoch with fully masked
rows; the next epoch starts a fresh stream.

Cursor (a JSON-able dict, the position where the next row starts):
    {"epoch": e, "doc": d, "offset": o, "skipped": k, "worker": w, "num_workers": n}
`doc` is the index of a document within this worker's shard, `offset` a token offset in that
document's ids, `skipped` the bad records before that position, each counted once per run (in
epoch 0: later epochs skip the same records again without counting them). At an
epoch's end the cursor is `{"epoch": e + 1, "doc": 0, "offset": 0, ...}`. A fresh worker built
with a batch's cursor produces exactly the batches that followed it.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

import numpy as np

from appliance.data.chat import ChatTemplate, FieldMap
from appliance.data.listing import find_data_files, named_files
from appliance.data.mixture import MixedShardReader, Source, source_counts
from appliance.data.packing import (
    IGNORE_INDEX,
    LONG_DOCUMENTS,
    fill_rows,
    fit_long_document,
    split_document,
)
from appliance.data.records import (
    ON_BAD_RECORD,
    SKIP_EXAMPLES,
    Batch,
    DataError,
    Holdout,
    RawDocument,
    Record,
    ShardReader,
    encode_records,
    load_tokenizer,
    parse_document,
    with_skip_hint,
)
from appliance.metrics.recorders import TokenizerMetrics
from appliance.storage.localize import localize, localize_data

ENCODE_CHUNK = 64  # documents per encode_batch call: amortizes the call, keeps read-ahead small

# One CPU per worker; RAYON_NUM_THREADS=1 stops the tokenizers library from spawning a thread
# per core in every worker (N workers would otherwise oversubscribe the node N-fold).
ACTOR_OPTIONS: dict[str, Any] = {
    "num_cpus": 1,
    "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": "1"}},
}

CURSOR_KEYS = ("epoch", "doc", "offset", "skipped", "worker", "num_workers")
PACKING = ("documents", "stream")
PACK_GROUP_ROWS = 32  # best fit packs this many rows' worth of tokens at a time (bounded buffer)


MAX_DEFAULT_WORKERS = 4


def default_num_workers(
    cpus_available: int, documents: int | None = None, max_workers: int = MAX_DEFAULT_WORKERS
) -> int:
    """Tokenizer workers for a node with `cpus_available` CPUs.

    Leaves one CPU for the trainer and never goes below one worker. Capped at `max_workers`: one
    core tokenizes far more tokens per second than one GPU trains on, and each worker is a
    process with its own memory. Never more than the data's `documents` (when known): each
    worker needs one (a single .txt file is one document).
    """
    cap = max_workers if documents is None else min(max_workers, documents)
    return max(1, min(cap, cpus_available - 1))


class TokenizeWorker:
    """Streams packed, labelled batches from shard `worker_index` of `num_workers`.

    `epochs=None` loops forever; otherwise `next_batch()` returns None after the last epoch.
    `on_bad_record="skip"` skips (and counts) bad records instead of raising DataError.
    Counters (`tokens_total`, `documents_total`, `skipped_total`, `batches_total`,
    `tokenize_seconds`) are plain attributes so a metrics layer can read them.
    """

    def __init__(
        self,
        data_path: str,
        tokenizer_path: str,
        worker_index: int,
        num_workers: int,
        seq_len: int,
        micro_batch_size: int,
        eos_id: int,
        pad_id: int | None,
        epochs: int | None = 1,
        on_bad_record: str = "fail",
        cursor: dict[str, Any] | None = None,
        packing: str = "documents",
        chat_template: ChatTemplate | None = None,
        holdout: Holdout | None = None,
        files: list[str] | None = None,
        long_documents: str = "split",
        fields: FieldMap | None = None,
        mix: list[tuple[str, float, list[str] | None]] | None = None,
        data_weight: float = 1.0,
    ):
        """`chat_template`: renders conversation records (None: they are refused). `holdout`:
        the documents of `--eval-split` this worker skips (or, for evaluation, only reads).
        `files`: the data files by name (`listing.file_names`), as the run listed them when it
        started: a worker restarted mid-run reads those, whatever the directory holds by then
        (None: the files `data_path` names now). `long_documents`: what becomes of a document
        longer than a row (packing.fit_long_document). `fields`: where conversations of another
        shape keep their messages (chat.FieldMap, from --field-messages and its kin). `mix`:
        further datasets (path, weight, their files by name as `files`) mixed with `data_path`
        at `data_weight` (data/mixture.py): the cursor then counts mixed documents."""
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} not in [0, num_workers={num_workers})")
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be >= 1"
            )
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (forever), got {epochs}")
        if on_bad_record not in ON_BAD_RECORD:
            raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
        if packing not in PACKING:
            raise ValueError(f"packing must be one of {PACKING}, got {packing!r}")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}: {long_documents!r}")
        self.long_documents = long_documents
        self.packing = packing
        self.chat_template = chat_template
        self.fields = fields
        self.holdout = holdout
        self.data_path = str(data_path)
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.epochs = epochs
        self.on_bad_record = on_bad_record

        self.files = find_data_files(data_path) if files is None else named_files(data_path, files)
        self.sources = None  # a mixture's datasets, with their document counts
        if mix:
            self.sources = [Source(tuple(self.files), data_weight)] + [
                Source(tuple(find_data_files(p) if n is None else named_files(p, n)), w)
                for p, w, n in mix
            ]
            self.counts = source_counts(self.sources)
        self.tokenizer = load_tokenizer(tokenizer_path)
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        pad_id = eos_id if pad_id is None else pad_id  # padding is masked: any valid id works
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < vocab:
                raise ValueError(f"{name} {value} is outside the tokenizer's vocabulary ({vocab})")
        self.eos_id, self.pad_id = eos_id, pad_id

        # Counters for metrics: work done by this process (read-ahead included).
        self.tokens_total = 0
        self.documents_total = 0
        self.skipped_total = 0
        self.batches_total = 0
        self.long_total = 0  # documents longer than a row (seq_len + 1 tokens) read
        self.long_tokens_left_out = 0  # their tokens --long-documents truncate/drop left out
        self.total_documents_seen = 0  # the whole dataset's documents, after a pass over it
        self.tokenize_seconds = 0.0
        self.last_skip_reason: str | None = None
        self._cut_note: str | None = None  # the first record cut, until a batch carries it
        self._cut_said = False
        self._skip_examples: dict[int, tuple[int, str]] = {}  # shard doc -> (epoch, why)
        self.metrics = TokenizerMetrics(worker_index)  # a no-op without Ray

        self.seek(cursor if cursor is not None else self._cursor_at(0, 0, 0, 0))

    # -- public API ------------------------------------------------------------------------

    def seek(self, cursor: dict[str, Any]) -> None:
        """Reposition at `cursor` (from a Batch or `cursor()`); the next batch starts there."""
        c = self._validate_cursor(cursor)
        self._epoch = c["epoch"]
        self._skipped_base = c["skipped"]  # bad records before the start position
        self._start_epoch_stream(c["doc"], c["offset"], c.get("row", 0))

    def cursor(self) -> dict[str, Any]:
        """The position where the next batch starts (after the last batch returned)."""
        if self.packing == "documents":
            if self._group is not None and self._row == len(self._group[0]):
                doc, row = self._next_start, 0  # this group is used up: the next one
            else:
                doc, row = self._group_start, self._row
            skipped = self._skipped_base + bisect.bisect_left(self._bad_docs, doc)
            return {**self._cursor_at(self._epoch, doc, 0, skipped), "row": row}
        if self._pos < len(self._ids):
            doc, off = int(self._doc[self._pos]), int(self._off[self._pos])
        else:
            doc, off = self._start
        skipped = self._skipped_base + bisect.bisect_left(self._bad_docs, doc)
        return self._cursor_at(self._epoch, doc, off, skipped)

    def next_batch(self) -> Batch | None:
        """The next micro-batch, or None when all epochs are done."""
        if self.epochs is not None and self._epoch >= self.epochs:
            return None
        epoch = self._epoch
        S, B = self.seq_len, self.micro_batch_size
        input_ids = np.full((B, S), self.pad_id, dtype=np.int64)
        labels = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
        positions = segments = None
        if self.packing == "documents":
            positions = np.tile(np.arange(S, dtype=np.int64), (B, 1))  # padding rows: causal
            segments = np.full((B, S), -1, dtype=np.int64)
            for b in range(B):
                if not self._next_document_row(input_ids[b], labels[b], positions[b], segments[b]):
                    break
        else:
            for b in range(B):
                if not self._next_row(input_ids[b], labels[b]):
                    break  # epoch over: the rest of the batch stays fully masked
        n_tokens = int((labels != IGNORE_INDEX).sum())
        self._targets_this_epoch += n_tokens
        # Look ahead so that a batch ending exactly at the epoch's end carries the next epoch's
        # cursor; a resumed worker then never emits an empty batch.
        if not self._has_next_row():
            self._end_epoch()
        self.batches_total += 1
        self.metrics.record_totals(
            self.tokens_total, self.documents_total, self.skipped_total, self.tokenize_seconds
        )
        cursor = self.cursor()
        # Bad records behind the cursor are final: fold them into the base count.
        passed = bisect.bisect_left(self._bad_docs, cursor["doc"])
        if passed:
            self._skipped_base += passed
            del self._bad_docs[:passed]
        return Batch(
            input_ids=input_ids,
            labels=labels,
            cursor=cursor,
            worker=self.worker_index,
            pid=os.getpid(),
            epoch=epoch,
            n_tokens=n_tokens,
            skipped_records=cursor["skipped"],
            positions=positions,
            segments=segments,
            cut_note=self._take_cut_note(),
        )

    def _take_cut_note(self) -> str | None:
        """The note of the first record this worker cut, on one batch only."""
        note, self._cut_note = self._cut_note, None
        return note

    def stats(self) -> dict[str, Any]:
        """Counters: `tokens`/`documents` tokenized by this process, `skipped_records` as in the
        cursor (whole run), `tokens_per_second` of reading + parsing + encoding."""
        return {
            "worker": self.worker_index,
            "pid": os.getpid(),
            "epoch": self._epoch,
            "batches": self.batches_total,
            "tokens": self.tokens_total,
            "documents": self.documents_total,
            "skipped_records": self.cursor()["skipped"],
            "last_skip_reason": self.last_skip_reason,
            "tokenize_seconds": self.tokenize_seconds,
            "tokens_per_second": (
                self.tokens_total / self.tokenize_seconds if self.tokenize_seconds > 0 else 0.0
            ),
        }

    def skip_examples(self, cursor: dict[str, Any] | None = None) -> list[tuple[int, str]]:
        """The first bad records this process skipped (at most SKIP_EXAMPLES), as (global
        document index, "file:line: problem"): those before `cursor` (default: this worker's),
        i.e. the ones a run at `cursor` has counted."""
        cursor = cursor or self.cursor()
        at = (cursor["epoch"], cursor["doc"])
        return [
            (doc * self.num_workers + self.worker_index, why)
            for doc, (epoch, why) in sorted(self._skip_examples.items())
            if (epoch, doc) < at
        ]

    # -- internals -------------------------------------------------------------------------

    def _cursor_at(self, epoch: int, doc: int, offset: int, skipped: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "doc": doc,
            "offset": offset,
            "skipped": skipped,
            "worker": self.worker_index,
            "num_workers": self.num_workers,
            **({"row": 0, "packing": "documents"} if self.packing == "documents" else {}),
        }

    def _validate_cursor(self, cursor: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(cursor, dict) or any(k not in cursor for k in CURSOR_KEYS):
            raise DataError(f"invalid data cursor {cursor!r}: expected keys {list(CURSOR_KEYS)}")
        bad = [k for k in CURSOR_KEYS if not isinstance(cursor[k], int) or cursor[k] < 0]
        if bad:
            raise DataError(f"invalid data cursor {cursor!r}: {bad} must be integers >= 0")
        packing = cursor.get("packing", "stream")
        if packing != self.packing:
            raise DataError(
                f"data cursor was taken with --packing {packing}, not {self.packing}: resume "
                f"with --packing {packing}"
            )
        if packing == "documents" and not (
            isinstance(cursor.get("row"), int) and cursor["row"] >= 0
        ):
            raise DataError(f"invalid data cursor {cursor!r}: 'row' must be an integer >= 0")
        if (cursor["worker"], cursor["num_workers"]) != (self.worker_index, self.num_workers):
            raise DataError(
                f"data cursor is for worker {cursor['worker']} of {cursor['num_workers']}, "
                f"not {self.worker_index} of {self.num_workers}: resume with the same number "
                "of tokenizer workers"
            )
        return cursor

    def _start_epoch_stream(self, doc: int, offset: int, row: int = 0) -> None:
        self._start = (doc, offset)
        if self.sources is not None:
            self._shard_reader: ShardReader | MixedShardReader = MixedShardReader(
                self.sources, self.worker_index, self.num_workers, doc, self.holdout,
                self._epoch, self.counts,
            )  # fmt: skip
        else:
            self._shard_reader = ShardReader(
                self.files, self.worker_index, self.num_workers, doc, self.holdout
            )
        self._reader = iter(self._shard_reader)
        self._shard_reader_done = False
        self._shard_docs_seen = 0  # documents (good or bad) read in this pass
        self._shard_bad_seen = 0
        self._must_resume_at = (doc, offset) if (doc, offset) != (0, 0) else None
        self._rows_this_epoch = 0
        self._targets_this_epoch = 0
        # documents packing: encoded documents read ahead, the packed group being returned
        self._docs: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._group: tuple[np.ndarray, ...] | None = None
        self._group_start, self._next_start, self._row, self._resume_row = doc, doc, 0, row
        self._bad_docs: list[int] = []  # shard indices of bad records read, >= the cursor doc
        # The token buffer, one entry per stream token: id, loss mask, document, offset in it.
        self._ids = np.empty(0, dtype=np.int64)
        self._mask = np.empty(0, dtype=bool)
        self._doc = np.empty(0, dtype=np.int64)
        self._off = np.empty(0, dtype=np.int64)
        self._pos = 0  # where the next row starts in the buffer

    def _end_epoch(self) -> None:
        if self._rows_this_epoch == 0:
            raise self._no_rows_error()
        if self._targets_this_epoch == 0 and self._start == (0, 0):
            raise DataError(
                f"worker {self.worker_index} of {self.num_workers}: no record of its shard of "
                f"{self.data_path} has a target token (nothing to learn); check the records "
                "(completions, assistant turns) and the chat template"
            )
        self.total_documents_seen = self._shard_reader.total_documents
        self._epoch += 1
        self._skipped_base += len(self._bad_docs)
        self._start_epoch_stream(0, 0)

    def _no_rows_error(self) -> DataError:
        where = f"worker {self.worker_index} of {self.num_workers}"
        if self._shard_docs_seen == 0:
            total = self._shard_reader.total_documents  # a full pass was made
            return DataError(
                f"{where} has no documents: {self.data_path} holds {total} document(s); "
                f"use at most {total} tokenizer worker(s)"
            )
        if self._shard_bad_seen == self._shard_docs_seen:
            return DataError(
                f"{where}: all {self._shard_docs_seen} record(s) of its shard of "
                f"{self.data_path} were bad and skipped (last: {self.last_skip_reason})"
            )
        return DataError(
            f"{where}: its shard of {self.data_path} has fewer than 2 tokens, so no training "
            "rows; add data or use fewer tokenizer workers"
        )

    def _has_next_row(self) -> bool:
        if self.packing == "documents":
            return self._ensure_group()
        return self._remaining(2) >= 2

    def _ensure_group(self) -> bool:
        """Make sure the current group has a row left, packing the next group if needed; False
        at the epoch's end."""
        if self._group is not None and self._row < len(self._group[0]):
            return True
        if self._group is not None:
            self._group_start = self._next_start
        S = self.seq_len
        pieces, slots, last = [], 0, None
        while slots < PACK_GROUP_ROWS * S:
            if not self._docs:
                if self._shard_reader_done:
                    break
                docs, encoded = self._read_encoded()
                self._docs.extend((d, ids, m) for d, (ids, m) in zip(docs, encoded, strict=True))
                continue
            doc, ids, mask = self._docs.pop(0)
            last = doc
            for piece in split_document(ids, mask, S):
                pieces.append(piece)
                slots += len(piece[0]) - 1
        if last is not None:
            self._next_start = last + 1
        if not pieces:
            self._group = None
            return False
        self._group = fill_rows(pieces, S, self.pad_id)
        self._row, self._resume_row = self._resume_row, 0
        if self._row >= len(self._group[0]):
            raise DataError(
                f"data cursor (doc {self._group_start}, row {self._row}) of worker "
                f"{self.worker_index} does not match {self.data_path}: the dataset or tokenizer "
                "changed since it was saved"
            )
        return True

    def _next_document_row(self, *rows: np.ndarray) -> bool:
        """Copy the next packed row (input_ids, labels, positions, segments) into `rows`."""
        if not self._ensure_group():
            return False
        for out, packed in zip(rows, self._group, strict=True):
            out[:] = packed[self._row]
        self._row += 1
        self._rows_this_epoch += 1
        return True

    def _remaining(self, n: int) -> int:
        """Tokens available from the current position, reading ahead until `n` or shard end."""
        while len(self._ids) - self._pos < n and not self._shard_reader_done:
            self._read_chunk()
        return len(self._ids) - self._pos

    def _next_row(self, input_row: np.ndarray, label_row: np.ndarray) -> bool:
        """Fill one row in place from the stream; False if the epoch has no more rows."""
        S = self.seq_len
        avail = self._remaining(S + 1)
        if avail < 2:  # a row needs at least one input and one target
            return False
        take = min(S + 1, avail)
        window = slice(self._pos, self._pos + take)
        ids, mask = self._ids[window], self._mask[window]
        input_row[: take - 1] = ids[:-1]
        label_row[: take - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        self._pos = min(self._pos + S, len(self._ids))  # rows overlap by one token
        self._rows_this_epoch += 1
        return True

    def _read_chunk(self) -> None:
        """Read, parse and encode up to ENCODE_CHUNK documents and append them to the buffer."""
        docs, encoded = self._read_encoded()
        t0 = time.perf_counter()
        offsets = [np.arange(len(ids), dtype=np.int64) for ids, _ in encoded]
        if encoded and self._must_resume_at is not None:
            self._check_resume_point(docs, encoded, offsets)
        # Drop consumed tokens so the buffer holds only read-ahead.
        keep = slice(self._pos, None)
        self._ids = np.concatenate([self._ids[keep], *(ids for ids, _ in encoded)])
        self._mask = np.concatenate([self._mask[keep], *(m for _, m in encoded)])
        doc_of_token = [
            np.full(len(o), d, dtype=np.int64) for d, o in zip(docs, offsets, strict=True)
        ]
        self._doc = np.concatenate([self._doc[keep], *doc_of_token])
        self._off = np.concatenate([self._off[keep], *offsets])
        self._pos = 0
        self.tokenize_seconds += time.perf_counter() - t0
        if self._shard_reader_done and self._must_resume_at is not None:
            self._check_resume_point([], [], [])

    def _read_encoded(self) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
        """Read, parse and encode up to ENCODE_CHUNK documents: (shard indices, (ids, mask))."""
        t0 = time.perf_counter()
        raws: list[RawDocument] = []
        for raw in self._reader:
            raws.append(raw)
            if len(raws) == ENCODE_CHUNK:
                break
        else:
            self._shard_reader_done = True
        self._shard_docs_seen += len(raws)
        good: list[tuple[int, Record]] = []
        for raw in raws:
            try:
                good.append((raw.doc, parse_document(raw, self.chat_template, self.fields)))
                if good[-1][1].cut and not self._cut_said:  # said once: the first one cut
                    self._cut_note, self._cut_said = good[-1][1].cut, True
            except DataError as e:
                if self.on_bad_record == "fail":
                    raise with_skip_hint(e) from None
                if self._epoch == 0:  # later epochs meet the same records: count each once
                    self._bad_docs.append(raw.doc)
                if len(self._skip_examples) < SKIP_EXAMPLES:  # for the warning that names them
                    self._skip_examples.setdefault(raw.doc, (self._epoch, str(e)))
                self._shard_bad_seen += 1
                self.skipped_total += 1
                self.last_skip_reason = str(e)
        encoded = encode_records(self.tokenizer, [r for _, r in good], self.eos_id)
        self.tokens_total += sum(len(ids) for ids, _ in encoded)
        self.documents_total += len(encoded)
        docs, kept = [], []
        for (doc, _), (ids, mask) in zip(good, encoded, strict=True):
            fitted = fit_long_document(ids, mask, self.seq_len, self.long_documents)
            if len(ids) > self.seq_len + 1:
                self.long_total += 1
                self.long_tokens_left_out += len(ids) - (0 if fitted is None else len(fitted[0]))
                if self._cut_note is None and not self._cut_said:
                    where = next(r.where for r in raws if r.doc == doc)
                    self._cut_note, self._cut_said = self._long_note(where, len(ids)), True
            if fitted is not None:
                docs.append(doc)
                kept.append(fitted)
        self.tokenize_seconds += time.perf_counter() - t0  # the caller adds its own part
        return docs, kept

    def _long_note(self, where: str, n: int) -> str:
        """The warning for the first document longer than a row (said once a run)."""
        done = {
            "split": "split into rows of --seq-len (an answer may train without its prompt)",
            "truncate": "its first --seq-len tokens trained, the rest left out",
            "drop": "left out",
        }[self.long_documents]
        return (
            f"{where}: a document of {n:,} tokens is longer than --seq-len {self.seq_len}: {done} "
            f"(--long-documents {self.long_documents}; split | truncate | drop)"
        )

    def _check_resume_point(
        self, docs: list[int], encoded: list[tuple[np.ndarray, np.ndarray]], offsets: list
    ) -> None:
        """On resume, trim the first document to the cursor's offset; the cursor must point at a
        token of a good document, or the dataset changed since the cursor was taken."""
        doc, offset = self._must_resume_at  # type: ignore[misc]
        if not docs or docs[0] != doc or offset >= len(encoded[0][0]):
            raise DataError(
                f"data cursor (doc {doc}, offset {offset}) of worker {self.worker_index} does "
                f"not match {self.data_path}: the dataset or tokenizer changed since it was saved"
            )
        ids, mask = encoded[0]
        encoded[0] = (ids[offset:], mask[offset:])
        offsets[0] = offsets[0][offset:]
        self._must_resume_at = None


class ShardWorker(TokenizeWorker):
    """A TokenizeWorker that first fetches its inputs (s3:// or a shared path) onto the node it
    runs on: tokenizer workers go wherever the cluster has CPUs."""

    def __init__(self, data_path: str, tokenizer_path: str, **kwargs: Any):
        if kwargs.get("mix"):  # further datasets: fetched alike
            kwargs["mix"] = [(str(localize_data(p)), w, n) for p, w, n in kwargs["mix"]]
        super().__init__(str(localize_data(data_path)), str(localize(tokenizer_path)), **kwargs)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
