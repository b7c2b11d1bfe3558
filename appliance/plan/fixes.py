"""What `appliance plan` says when a run does not fit: the problems (GPU memory, host RAM: what
each needs against what there is, and what makes it smaller) and the changes that fix them.

Every change is planned again before it is offered. A change is offered when it makes the GPU
and the host both fit; when one only fixes the GPU, it is offered together with the host change
that completes it (`--base-quant`, fewer micro-batches), or with a plain statement of the host RAM
that still lacks.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.hardware import gpus as hardware
from appliance.plan.estimate import GiB, PlanInput, evaluate, smaller_quants

SHORTEST_SEQ_LEN = 128  # the shortest --seq-len suggested


def _gib(n: float) -> str:
    return f"{n / GiB:.0f} GiB"


def problems(p: PlanInput, r: dict) -> list[str]:
    """One line for each of GPU and host that does not fit: needed against available."""
    out = []
    if not r["gpu_fits"]:
        out.append(
            f"GPU memory: needs at least {r['gpu_min_bytes'] / GiB:.1f} GiB, the budget is "
            f"{p.budget / GiB:.1f} GiB"
        )
    if not r["host_fits"]:
        h, inst = r["host_bytes"], p.card.instance
        has = f"the {inst.name}'s {_gib(inst.host_ram_bytes)}"
        if r["host_ram_bytes"] < inst.host_ram_bytes:
            has += f" ({_gib(r['host_ram_bytes'])} for {p.gpus} of its {inst.gpus} GPUs)"
        store = f"weight store {_gib(h['weight_store'])}"
        if smaller_quants(p.base_quant):
            store += " (--base-quant shrinks it)"
        parts = [store]
        if h["offloaded_activations"]:
            parts.append(
                f"activations offloaded to host {_gib(h['offloaded_activations'])} (fewer, "
                "smaller or shorter micro-batches shrink them)"
            )
        parts.append(f"processes {_gib(h['trainer_processes'] + h['tokenizer_workers'])}")
        out.append(f"host RAM: needs {_gib(h['ram_needed'])} of {has}: " + ", ".join(parts))
    return out


def fixes(p: PlanInput, m: int, r: dict) -> list[str]:
    """The changes, flag by flag, that make the plan fit (each planned again first)."""
    out = []
    for options in _changes(p, m):
        offer = _first_that_fits(p, m, options)
        if offer is None and not r["gpu_fits"]:
            offer = _gpu_then_host(p, m, options)
        if offer is not None:
            out.append(offer)
    if r["gpu_fits"] and not r["host_fits"]:
        out.append(f"a host with {_gib(r['host_bytes']['ram_needed'])} of RAM or more")
    return out


# A change: PlanInput fields and their new values; "micro_batches_per_step" is M.
Change = dict


def _apply(p: PlanInput, m: int, change: Change) -> tuple[PlanInput, int]:
    """The plan with `change` made. A `--gpu` change keeps the budget given unless the change
    drops it too (and then says so: `_says`)."""
    fields = {k: v for k, v in change.items() if k != "micro_batches_per_step"}
    return replace(p, **fields), change.get("micro_batches_per_step", m)


def _says(change: Change) -> str:
    """The change in flags: `lower --seq-len to 2048 and --base-quant nf4`."""
    parts = []
    for key, v in change.items():
        flag = "--" + key.replace("_", "-")
        if key == "gpu_memory_budget" and "gpu" in change:
            continue  # said with the GPU: `--gpu l40s without --gpu-memory-budget`
        if key == "gpu_memory_budget":
            parts.append(f"drop {flag} (the default is 90% of the card)")
        elif key == "gpu":
            g = hardware.GPUS[v]
            without = " without --gpu-memory-budget" if "gpu_memory_budget" in change else ""
            parts.append(
                f"{flag} {v}{without} ({g.memory_bytes / GiB:.0f} GiB GPU, on a host with "
                f"{_gib(g.instance.host_ram_bytes)} of RAM)"
            )
        elif not parts and key in ("seq_len", "micro_batch_size", "micro_batches_per_step"):
            parts.append(f"lower {flag} to {v}")
        else:
            parts.append(f"{flag} {v}")
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _halvings(v: int, lowest: int) -> list[int]:
    """v/2, v/4, ... down to `lowest`."""
    out = []
    v //= 2
    while v >= lowest:
        out.append(v)
        v //= 2
    return out


def _changes(p: PlanInput, m: int) -> list[list[Change]]:
    """The one-flag changes, grouped by flag, each group in order of preference (least first)."""
    groups = [
        [{"micro_batch_size": v} for v in _halvings(p.micro_batch_size, 1)],
        [{"seq_len": v} for v in _halvings(p.seq_len, SHORTEST_SEQ_LEN)],
        [{"micro_batches_per_step": v} for v in _halvings(m, 1)],
        [{"base_quant": q} for q in smaller_quants(p.base_quant)],
    ]
    drop: Change = {"gpu_memory_budget": None}
    if p.gpu_memory_budget is not None and p.gpu_memory_budget < p.card.memory_bytes:
        groups.append([drop])
    here = p.card
    others = sorted(
        (g.memory_bytes, g.instance.host_ram_bytes, k)
        for k, g in hardware.GPUS.items()
        if g.memory_bytes > here.memory_bytes
        or g.instance.host_ram_bytes > here.instance.host_ram_bytes
    )
    # another card keeps the budget given; one without it too only when dropping the budget on
    # this card is not already the fix (else "--gpu l4" would pass for what the drop did)
    also_drop = p.gpu_memory_budget is not None and not evaluate(*_apply(p, m, drop))["fits"]
    groups.append(
        [
            change
            for _, _, k in others
            for change in ({"gpu": k}, *([{"gpu": k, **drop}] if also_drop else []))
        ]
    )
    return groups


def _first_that_fits(p: PlanInput, m: int, options: list[Change]) -> str | None:
    for change in options:
        if evaluate(*_apply(p, m, change))["fits"]:
            return _says(change)
    return None


def _gpu_then_host(p: PlanInput, m: int, options: list[Change]) -> str | None:
    """When no option fits GPU and host both: the first that fits the GPU, with the host change
    that completes it, or saying what host RAM it still needs."""
    for change in options:
        q, k = _apply(p, m, change)
        e = evaluate(q, k)
        if not e["gpu_fits"]:
            continue
        more = _first_that_fits(p, m, [{**change, **h} for h in _host_changes(q, k)])
        if more is not None:
            return more
        if "gpu" in change and q.card.memory_bytes <= p.card.memory_bytes:
            continue  # a card with no more GPU memory: offered only where it fits, host too
        return (
            f"{_says(change)}: the GPU then fits, but host RAM still needs "
            f"{_gib(e['host_bytes']['ram_needed'])} of {_gib(e['host_ram_bytes'])}"
        )
    return None


def _host_changes(p: PlanInput, m: int) -> list[Change]:
    """What shrinks host RAM: a smaller --base-quant, fewer micro-batches, then both."""
    quants = [{"base_quant": q} for q in smaller_quants(p.base_quant)]
    fewer = [{"micro_batches_per_step": v} for v in _halvings(m, 1)]
    return [*quants, *fewer, *({**q, **f} for q in quants for f in fewer)]
