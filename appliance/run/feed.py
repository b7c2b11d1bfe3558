"""The data feed of a run: what each tokenizer worker is given, and which worker supplies
each of the run's micro-batches (round-robin over the workers, in a fixed schedule that a resumed
run replays from its position)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.actors.tokenize_worker import ShardWorker
from appliance.data.records import SKIP_EXAMPLES, Holdout, skipped_message
from appliance.storage import uri as storage

if TYPE_CHECKING:
    from appliance.run.state import Inputs


def worker_kwargs(
    inp: Inputs, index: int, num_workers: int, epochs: int | None, cursor: dict | None = None
) -> dict:
    cfg = inp.cfg
    return dict(
        data_path=cfg.data,  # a URI: each worker fetches it on its own node
        tokenizer_path=storage.join(cfg.model, "tokenizer.json"),
        worker_index=index,
        num_workers=num_workers,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        eos_id=inp.eos_id,
        pad_id=inp.pad_id,
        epochs=epochs,
        on_bad_record=cfg.on_bad_record,
        cursor=cursor,
        packing=cfg.packing,
        chat_template=inp.chat_template,
        holdout=Holdout(cfg.eval_split, cfg.seed) if cfg.eval_split else None,
        files=inp.data_files,  # as listed at the start: a restart reads the same documents
        fields=cfg.field_map(),
        mix=[(p, w, names) for (p, w), names in zip(cfg.mixture(), inp.mix_files, strict=True)],
        data_weight=cfg.data_weight,
    )


def count_batches(kwargs: dict) -> int:
    """Micro-batches one worker yields in one epoch (a tokenizing pre-pass, for --epochs)."""
    worker = ShardWorker(**{**kwargs, "epochs": 1, "cursor": None})
    n = 0
    while worker.next_batch() is not None:
        n += 1
    return n


def schedule(counts: list[int] | None, num_workers: int, total: int) -> list[int]:
    """Which worker supplies each of the run's `total` micro-batches: round-robin, skipping
    workers whose shard is used up (with --epochs, `counts` is batches per worker in all)."""
    if counts is None:
        return [g % num_workers for g in range(total)]
    left = list(counts)
    order: list[int] = []
    w = 0
    while len(order) < total and any(left):
        if left[w] > 0:
            order.append(w)
            left[w] -= 1
        w = (w + 1) % num_workers
    return order


def skipped_warning(total: int, workers: list, cursors: dict[int, dict]) -> str:
    """`--on-bad-record skip`: the run skipped `total` bad records; the first few, each with its
    `file:line` and problem, as the tokenizer workers (Ray actors) that read them remember them,
    up to the run's position `cursors` (worker -> cursor) in their shards."""
    import ray

    try:
        found = ray.get([workers[w].skip_examples.remote(c) for w, c in cursors.items()])
    except ray.exceptions.RayError:  # a worker that died just now: the count alone
        found = []
    examples = sorted(e for per_worker in found for e in per_worker)[:SKIP_EXAMPLES]
    why = [problem for _, problem in examples]
    return "warning: " + skipped_message(total, why, "the training data")
