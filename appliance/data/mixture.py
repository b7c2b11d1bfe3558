"""Several datasets in one run, each with a mixing weight: `--data A --mix-data B=0.5,C=2`.

A weight is how many times a dataset's documents are read per epoch of the run: dataset i of
n_i documents and weight w_i gives q_i = max(1, round(w_i * n_i)) documents to each epoch
(`quota`). At 1 each document once; at 2 each twice; at 0.5 half of them, the next half in the
next epoch (epoch e starts dataset i at document e * q_i mod n_i and reads on cyclically), so
every document comes round. An epoch's documents are the datasets' quotas interleaved as evenly
as their sizes allow (`mix_order`: the k-th document of dataset i sits at (k + 1/2) / q_i of the
epoch, ties to the lower i), so each stretch of training sees the mixture, not one dataset after
another.

The mixed order is a function of the datasets' files (listed once when the run starts), their
document counts (each worker counts them when it starts) and the epoch: nothing random, nothing
that depends on timing. So the run's workers deal the mixed documents out as they deal one
dataset's (worker w of N reads mixed positions g with g % N == w), a worker's cursor counts
mixed positions, and a resumed or restarted worker reads the very same documents from its
cursor on. `--eval-split` holds documents out by their dataset and place in it, so a document
read twice an epoch is held out (or trained) both times; the validation set is every held-out
document of every dataset, once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.data.files import count_documents
from appliance.data.records import Holdout, RawDocument, document_data, file_documents


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its data files in document order and its weight."""

    files: tuple[Path, ...]
    weight: float


def source_counts(sources: Sequence[Source]) -> list[int]:
    """Each dataset's documents (a pass over its files; `find_data_files` made sure of one)."""
    return [count_documents(s.files, 1 << 62) for s in sources]


def quota(weight: float, documents: int) -> int:
    """Documents a dataset of `documents` gives each epoch at `weight` (at least one)."""
    return max(1, round(weight * documents))


def mix_order(quotas: Sequence[int]) -> Iterator[int]:
    """The dataset of each position of an epoch: dataset i `quotas[i]` times, spread evenly
    (its k-th at (k + 1/2) / quotas[i] of the epoch; ties to the lower index). Integer
    arithmetic only: every process computes the same order."""
    taken = [0] * len(quotas)
    for _ in range(sum(quotas)):
        # the smallest (2 * taken_i + 1) / (2 * q_i), compared by cross-multiplying
        best = 0
        for i in range(1, len(quotas)):
            if (2 * taken[i] + 1) * quotas[best] < (2 * taken[best] + 1) * quotas[i]:
                best = i
        taken[best] += 1
        yield best


def _cycle(files: Sequence[Path], start: int) -> Iterator[tuple[int, str, object, str]]:
    """A dataset's documents from document `start` on, round and round: (index, where, data,
    kind) as `file_documents` gives them."""
    while True:
        j = 0
        for f in files:
            for where, data, kind in file_documents(f):
                if j >= start:
                    yield j, where, data, kind
                j += 1
        if j == 0:
            return
        start = 0


class MixedShardReader:
    """`records.ShardReader` over a mixture of datasets: one worker's share of an epoch's mixed
    documents, from shard index `start_doc` (module doc). `holdout` with `held_out` (the
    validation set) reads each held-out document of each dataset once, unmixed."""

    def __init__(
        self,
        sources: Sequence[Source],
        worker_index: int,
        num_workers: int,
        start_doc: int = 0,
        holdout: Holdout | None = None,
        epoch: int = 0,
        counts: Sequence[int] | None = None,
    ):
        """`counts`: each dataset's documents (`source_counts`), when known: else counted."""
        self.sources = list(sources)
        self.counts = list(counts) if counts is not None else None
        self.worker_index, self.num_workers = worker_index, num_workers
        self.start_doc, self.holdout, self.epoch = start_doc, holdout, epoch
        self.total_documents = 0

    def _kept(self, i: int, j: int) -> bool:
        """Whether document j of dataset i is read: trained, or held out for validation."""
        return self.holdout is None or self.holdout.wants(f"{i}:{j}")

    def __iter__(self) -> Iterator[RawDocument]:
        N, w = self.num_workers, self.worker_index
        first = self.start_doc * N + w
        g = 0
        if self.holdout is not None and self.holdout.held_out:  # the validation set
            for i, source in enumerate(self.sources):
                j = 0
                for f in source.files:
                    for where, data, kind in file_documents(f):
                        if g >= first and g % N == w and self._kept(i, j):
                            yield RawDocument(g // N, where, document_data(data), kind)
                        g, j = g + 1, j + 1
            self.total_documents = g
            return
        counts = self.counts if self.counts is not None else source_counts(self.sources)
        quotas = [quota(s.weight, n) for s, n in zip(self.sources, counts, strict=True)]
        streams = [
            _cycle(s.files, self.epoch * q % n)
            for s, q, n in zip(self.sources, quotas, counts, strict=True)
        ]
        for i in mix_order(quotas):
            j, where, data, kind = next(streams[i])
            if g >= first and g % N == w and self._kept(i, j):
                yield RawDocument(g // N, where, document_data(data), kind)
            g += 1
        self.total_documents = g
