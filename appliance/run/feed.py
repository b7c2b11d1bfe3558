"""The data feed of a run: what each tokenizer worker is given, and which worker supplies
each of the run's micro-batches (round-robin over the workers, in a fixed schedule that a resumed
run replays from its position)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.actors.tokenize_worker import ShardWorker
from appliance.data.records import SKIP_EXAMPLES, Holdout, skipped_message
from appliance.storage import uri as storage

if TYPE_CHECKING:
    from appliance.config import TrainConfig
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
        long_documents=cfg.long_documents,
        fields=cfg.field_map(),
        mix=[(p, w, names) for (p, w), names in zip(cfg.mixture(), inp.mix_files, strict=True)],
        data_weight=cfg.data_weight,
    )


class _Uncounted:
    """The tokenizer metrics of a counting pass: none (the run's workers count what they read)."""

    def record_totals(self, *args: object, **kwargs: object) -> None:
        pass


def count_batches(kwargs: dict) -> dict:
    """What one worker's shard holds in one epoch (a tokenizing pre-pass: for --epochs, and for
    --steps on small data): `batches` (micro-batches), `documents` and `tokens` read, `long`
    (documents longer than a row) and `long_left_out` (their tokens --long-documents truncate or
    drop left out), `read` (documents of its shard, bad ones too), `total` (the whole dataset's
    documents, held-out ones too)."""
    worker = ShardWorker(**{**kwargs, "epochs": 1, "cursor": None})
    worker.metrics = _Uncounted()  # the run's workers record what they read, once
    n = 0
    while worker.next_batch() is not None:
        n += 1
    return {
        "batches": n,
        "documents": worker.documents_total,
        "tokens": worker.tokens_total,
        "long": worker.long_total,
        "long_left_out": worker.long_tokens_left_out,
        "read": worker.documents_total + worker.skipped_total,
        "total": worker.total_documents_seen,
    }


#: --steps runs count their data before the first step (as --epochs runs must) when it is this
#: small: a pass over it costs seconds; a bigger corpus is not read twice for a summary
COUNT_DATA_BYTES = 64 * 2**20


REPEATS_WARNING = 10  # epochs from which a run is warned that it repeats its data


def small_data(inp: Inputs) -> bool:
    """Whether a --steps run's data is small enough to count first (COUNT_DATA_BYTES)."""
    files = (inp.data_fingerprint or {}).get("files")
    return files is not None and sum(size for _, size, _ in files) <= COUNT_DATA_BYTES


def length_notes(
    cfg: TrainConfig, total: int, per_epoch: float | None, per_step: int, demo: bool = False
) -> list[str]:
    """How long a run of `total` steps is in steps and epochs (`per_epoch` steps an epoch; None
    when the data was not counted), its warm-up; warnings when the warm-up is as long as the
    run or small data is repeated many times (not for the demo, which does it on purpose)."""
    rows = per_step * cfg.micro_batch_size
    line = f"run: {total:,} steps of {rows:,} rows of {cfg.seq_len} tokens"
    if per_epoch:
        line += f", {total / per_epoch:.3g} epoch(s) of {per_epoch:.3g} steps"
    else:
        line += f" (the data is over {COUNT_DATA_BYTES >> 20} MiB: not counted, no epochs)"
    warmup = cfg.warmup_steps
    ratio = f" (--warmup-ratio {cfg.warmup_ratio})" if cfg.warmup_ratio is not None else ""
    notes = [f"{line}; warm-up {warmup:,} steps{ratio}"]
    if warmup >= total and total > 1:
        notes.append(
            f"warning: the warm-up ({warmup} steps) is as long as the run ({total} steps): the "
            f"learning rate never reaches --lr {cfg.lr:g} and never decays; give fewer "
            "--warmup-steps, or --warmup-ratio 0.03 to 0.1"
        )
    if per_epoch and total / per_epoch >= REPEATS_WARNING and not demo:
        notes.append(
            f"warning: the run passes over its data {total / per_epoch:.3g} times "
            f"({per_epoch:.3g} steps an epoch): a small dataset repeated this often is memorised "
            "more than learned; give more data, or fewer --steps (--epochs 1 to 3 is usual)"
        )
    return notes


def data_summary(counts: list[dict], inp: Inputs, per_step: int) -> list[str]:
    """The lines a run says at start about its data, from count_batches of every worker."""
    cfg = inp.cfg
    docs, tokens = sum(c["documents"] for c in counts), sum(c["tokens"] for c in counts)
    said = [f"data: {docs:,} documents, {tokens:,} tokens read"]
    held = counts[0]["total"] - sum(c["read"] for c in counts) if counts else 0
    if cfg.eval_split:
        said[0] += f"; {held:,} held out for validation (--eval-split {cfg.eval_split})"
    long = sum(c["long"] for c in counts)
    if long:
        left = sum(c["long_left_out"] for c in counts)
        done = {
            "split": "split into rows of --seq-len",
            "truncate": f"truncated to it ({left:,} tokens left out)",
            "drop": f"left out ({left:,} tokens)",
        }[cfg.long_documents]
        said.append(
            f"warning: {long:,} of the {docs:,} documents are longer than --seq-len "
            f"{cfg.seq_len}: {done} (--long-documents {cfg.long_documents}; split | truncate | "
            "drop)"
        )
    return said


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
