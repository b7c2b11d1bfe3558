"""Expert-granular streaming: a MoE block's experts cross to the device only when a token needs
them (DeviceWeights, `experts=`).

A streamed MoE block is copied in two parts. Its dense part (norms, attention, router: every
tensor but the experts') is copied as a whole block is, ahead of use. Its experts are copied
into the same streaming slot, at the offsets they have in the block's flat buffer, when a
micro-batch's router first picks them: moe.experts_forward asks for the experts it routed to
(`ExpertBlock.need`) before it runs any, so each pass copies the union, over the pass's
micro-batches, of the experts that received at least one token, each once. The backward's
prefetch of a block copies the experts its forward used (the recompute routes the same tokens
the same way), so the backward never waits for an expert. A forward's prefetch of a block
copies, beside its dense part, the experts the block's previous pass routed to (routing
changes little between steps, and at a few hundred tokens a step every expert is routed to):
those copies overlap the previous block's compute instead of stalling the forward when the
router reaches them; a miss is copied on demand (`expert_waits`), an extra moves for nothing. What is copied is bitwise what a
whole-block copy holds at those offsets: the result equals whole-block streaming bit for bit.

Only experts stored apart (moe.Layout: Qwen3-MoE, Mixtral, OLMoE) and not quantized stream by
expert; other blocks stream whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.engine.blocks import entry_nbytes
from appliance.models.moe import Layout

Span = tuple[int, int]  # [start, end) bytes of a block's flat buffer


def _merged(spans: list[Span]) -> list[Span]:
    """Spans sorted, touching ones joined (fewer, bigger copies)."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def expert_spans(index: dict, layout: Layout) -> tuple[list[Span], dict[int, list[Span]]]:
    """(the dense part's spans, expert → its spans) of a block's flat buffer (blocks.layout's
    index: name → (offset, shape, dtype name))."""
    dense: list[Span] = []
    experts: dict[int, list[Span]] = {}
    for name, (off, shape, dtype_name) in index.items():
        span = (off, off + entry_nbytes(tuple(shape), dtype_name))
        j = layout.expert_of(name)
        (dense if j is None else experts.setdefault(j, [])).append(span)
    return _merged(dense), {j: _merged(s) for j, s in experts.items()}


class ExpertBlock(dict):
    """A streamed MoE block's weights (name → tensor, views of its slot) whose experts are
    copied in when first needed: `need(experts)` copies those not yet there (one batch), and
    reading an expert's tensor copies its expert first if `need` was not asked (a safety net:
    moe.experts_forward always asks)."""

    def __init__(self, w: dict, layout: Layout, fetch: Callable[[Iterable[int]], None]):
        super().__init__(w)
        self._layout, self._fetch = layout, fetch

    def need(self, experts: Iterable[int]) -> None:
        self._fetch(experts)

    def __getitem__(self, name: str):
        j = self._layout.expert_of(name)
        if j is not None:
            self._fetch((j,))
        return super().__getitem__(name)
