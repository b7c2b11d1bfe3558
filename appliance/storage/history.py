"""The run's per-step history (training losses, validation losses), kept once.

Every checkpoint's driver state carried the whole history, so each checkpoint wrote it all again
and a run's checkpoint I/O grew with the square of its steps (docs/benchmarks.md, "Soak"). Now a
checkpoint writes only what came since the one before, as one segment under
`OUTPUT/checkpoints/history/` that names the segment before it, and its driver state names its
last segment (`history`) and the history's length. A resume reads the chain back from there: the
checkpoint's own history, whichever checkpoint it falls back to (a segment a later, abandoned
checkpoint wrote is simply not on its chain). Segments are never pruned: together they are the
history, once. A driver state from before segments holds the whole history itself."""

from __future__ import annotations

import json
import secrets
from typing import Any

from appliance.storage import uri as storage

HISTORY_DIR = "history"  # under OUTPUT/checkpoints


def history_uri(checkpoints: str) -> str:
    """`OUTPUT/checkpoints/history` of the checkpoints directory `checkpoints`."""
    return storage.join(checkpoints, HISTORY_DIR)


def write_segment(
    checkpoints: str, prev: str | None, start: int, losses: list[float], evals: list[list]
) -> str:
    """Write the losses of steps start+1.. (and the validation losses since the last segment)
    as a new segment after `prev`; its name."""
    name = f"losses-{start + 1:06d}-{start + len(losses):06d}-{secrets.token_hex(4)}.json"
    body = {"prev": prev, "start": start, "losses": losses, "eval_losses": evals}
    storage.write_bytes(storage.join(history_uri(checkpoints), name), json.dumps(body).encode())
    return name


def read_chain(checkpoints: str, last: str, length: int) -> tuple[list[float], list[list]]:
    """The history whose last segment is `last`: (losses of steps 1..length, validation
    losses). ValueError, naming the segment, when the chain is broken or short."""
    segments: list[dict[str, Any]] = []
    name: str | None = last
    while name is not None:
        if "/" in name or not name.startswith("losses-"):
            raise ValueError(f"history segment {name!r} is not one appliance writes")
        body = json.loads(storage.read_bytes(storage.join(history_uri(checkpoints), name)))
        segments.append(body)
        name = body.get("prev")
        if len(segments) > 10_000_000:
            raise ValueError("history segments form a loop")
    losses: list[float] = []
    evals: list[list] = []
    for body in reversed(segments):
        if body["start"] != len(losses):
            raise ValueError(f"history segment after step {len(losses)} starts at {body['start']}")
        losses += body["losses"]
        evals += body["eval_losses"]
    if len(losses) != length:
        raise ValueError(f"the history holds {len(losses)} steps, the checkpoint {length}")
    return losses, evals
