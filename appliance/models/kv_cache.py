"""Keys and values kept across decoding steps (`appliance generate`), one `KVCache` per block.

The blocks run unchanged: a block's attention is handed its KVCache where training hands it a
mask (`layers.attention`, `layers.attend`), appends the new tokens' keys and values to it, and
attends over every key so far with the visibility `Positions` gives (the same kernels as a
masked training pass: `layers.masked_sdpa`, or Gemma 2's soft-capped scores).

Slots and positions: the cache of a batch of prompts of different lengths has one slot per token
kept, (B, nkv, slots, hs). Prompt r fills slots 0..len_r-1 (the slots up to the longest prompt
past its end are padding, never seen); each generated token takes the next slot, the same for
every row. `Positions.slots` holds each slot's position in its row's sequence (-1: padding), so
a query at position p sees the slots of positions 0..p (and, in a sliding-window layer, only
those within the window): exactly the causal attention of that row alone.

A cache lives on the compute device, or in host memory (`store`, page-locked on CUDA) when the
device's budget has no room for it: then its keys and values cross to the device for each
block's step, and the new ones are written back.
"""

from __future__ import annotations

import torch


class Positions:
    """Every slot's position (B, slots; -1 where nothing is), and the positions of the queries
    of the step in flight (B, T): what each query may see, per window size."""

    def __init__(self, slots: torch.Tensor):
        self.slots = slots
        self.queries: torch.Tensor | None = None
        self._visible: dict[int | None, torch.Tensor] = {}

    def start_step(
        self, queries: torch.Tensor, first_slot: int, keys: torch.Tensor | None = None
    ) -> None:
        """The step's queries (B, T), at their positions, take slots first_slot..
        first_slot + T - 1; `keys`: those slots' positions as keys when some are padding (-1:
        never seen; the query there still sees its row's earlier keys, so stays finite)."""
        T = queries.shape[1]
        self.slots[:, first_slot : first_slot + T] = queries if keys is None else keys
        self.queries = queries
        self.length = first_slot + T
        self._visible = {}

    def visible(self, window: int | None) -> torch.Tensor:
        """(B, 1, T, length) bool: query t sees slot j (a key at or before it, not padding,
        within `window` positions when the layer has one)."""
        if window not in self._visible:
            keys = self.slots[:, None, : self.length]  # (B, 1, S)
            queries = self.queries[:, :, None]  # (B, T, 1)
            keep = (keys >= 0) & (keys <= queries)
            if window is not None:
                keep &= queries - keys < window
            self._visible[window] = keep[:, None]
        return self._visible[window]


class KVCache:
    """One block's keys and values, (B, nkv, capacity, hs) each, kept in `store` (the compute
    device, or host memory), handed to the block's attention in place of a mask."""

    def __init__(
        self,
        positions: Positions,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        store: torch.device,
    ):
        self.positions, self.device = positions, device
        pin = store.type == "cpu" and device.type == "cuda"
        self.k = torch.empty(shape, dtype=dtype, device=store, pin_memory=pin)
        self.v = torch.empty(shape, dtype=dtype, device=store, pin_memory=pin)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values (B, nkv, T, hs) at their slots; every key and value
        so far, on the compute device."""
        n = self.positions.length
        start = n - k.shape[2]
        self.k[:, :, start:n].copy_(k)
        self.v[:, :, start:n].copy_(v)
        return self.k[:, :, :n].to(self.device), self.v[:, :, :n].to(self.device)

    def visible(self, window: int | None) -> torch.Tensor:
        return self.positions.visible(window)
