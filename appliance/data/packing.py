"""Packing documents into rows without cross-document attention (`--packing documents`).

A document of n tokens (ids, with the loss mask of records.encode_records) fills n − 1 row slots:
its inputs are ids[:-1], its targets ids[1:] where the mask allows. A document longer than
`seq_len` + 1 tokens is split into pieces of seq_len + 1 tokens overlapping by one (so every token
but the document's first is still a target once), each piece its own document. In a row each
piece gets its own segment id and positions 0, 1, ...; the attention mask lets a token see only
earlier tokens of its own segment, so the loss of a packed row equals the sum of its documents'
losses computed one by one. Padding gets segment −1 (it attends only to padding, and has no
target).

Rows are filled by best-fit decreasing over a bounded group of pieces: the longest piece goes into
the row with the least room that still holds it. A piece shorter than seq_len is never split.
"""

from __future__ import annotations

import numpy as np

#: a target position with no loss: PyTorch's cross_entropy ignore_index, the value the model's
#: loss skips (models.layers.IGNORE_INDEX, the same; tests/data/test_packing.py holds them equal).
#: Written here, not imported: the tokenizer workers use it and import no torch.
IGNORE_INDEX = -100

PAD_SEGMENT = -1

Piece = tuple[np.ndarray, np.ndarray]  # (ids int64, loss mask bool), at least 2 tokens

#: --long-documents: what becomes of a document longer than a row (seq_len + 1 tokens)
LONG_DOCUMENTS = ("split", "truncate", "drop")


def fit_long_document(ids: np.ndarray, mask: np.ndarray, seq_len: int, how: str) -> Piece | None:
    """A document as --long-documents `how` trains it: as it is when it fits one row
    (seq_len + 1 tokens: seq_len inputs, seq_len targets) or `how` is split (split_document
    cuts it into rows); its first seq_len + 1 tokens (truncate: the rest is not trained on); None
    (drop: not trained on at all, as a chat whose answer would lose its prompt)."""
    if len(ids) <= seq_len + 1 or how == "split":
        return ids, mask
    if how == "truncate":
        return ids[: seq_len + 1], mask[: seq_len + 1]
    return None


def split_document(ids: np.ndarray, mask: np.ndarray, seq_len: int) -> list[Piece]:
    """The pieces of one document: seq_len + 1 tokens each, overlapping by one token; a last
    piece of a single token (nothing to predict) is dropped, as is a document under 2 tokens."""
    out = []
    for start in range(0, max(len(ids) - 1, 0), seq_len):
        piece = slice(start, start + seq_len + 1)
        out.append((ids[piece], mask[piece]))
    return out


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of item indices, each row's lengths summing to at most `capacity`, by best-fit
    decreasing (ties broken by index, so the result is deterministic). Within a row the items
    keep their original order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        fits = [r for r in range(len(rows)) if room[r] >= n]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
        else:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    return [sorted(row) for row in rows]


def fill_rows(
    pieces: list[Piece], seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pack `pieces` into rows: (input_ids, labels, positions, segments), each (R, seq_len) int64.

    `labels[r, t]` is the target of `input_ids[r, t]` (−100 where none); `positions` restart at 0
    for each piece; `segments` number the pieces of a row 0, 1, ... (−1 on padding)."""
    rows = best_fit([len(ids) - 1 for ids, _ in pieces], seq_len)
    R = len(rows)
    input_ids = np.full((R, seq_len), pad_id, dtype=np.int64)
    labels = np.full((R, seq_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((R, seq_len), dtype=np.int64)
    segments = np.full((R, seq_len), PAD_SEGMENT, dtype=np.int64)
    for r, row in enumerate(rows):
        o = 0
        for seg, i in enumerate(row):
            ids, mask = pieces[i]
            n = len(ids) - 1
            input_ids[r, o : o + n] = ids[:-1]
            labels[r, o : o + n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            positions[r, o : o + n] = np.arange(n)
            segments[r, o : o + n] = seg
            o += n
    return input_ids, labels, positions, segments
