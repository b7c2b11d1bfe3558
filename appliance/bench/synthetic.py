"""Random weights of a real model's shape, made in memory for `appliance bench` (nothing is
downloaded): a block source the engine streams exactly like the weight store's."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from appliance import quant
from appliance.engine.blocks import FlatIndex, layout, pack, unpack
from appliance.models import block_shapes, global_shapes
from appliance.models.layers import ModelArgs


class SyntheticBlockSource:
    """A block source of random weights, each block made on first use (then kept).

    Values are N(0, 0.02) tiled from one pool of random numbers at a different offset per tensor:
    making 70B parameters with a random generator would take minutes, a copy takes seconds. Norm
    weights are 1. Blocks are built directly as flat buffers (`flat_block`), so a CUDA engine
    page-locks and uploads them without another copy; `block(i)` returns views of the same
    memory.
    """

    POOL = 2**24 - 3  # odd length: consecutive rows of a tiled matrix do not repeat

    def __init__(
        self, args: ModelArgs, dtype: torch.dtype, seed: int = 0, base_quant: str = "none"
    ):
        self.args, self.dtype = args, dtype
        self.base_quant = base_quant  # int8 | nf4: linear weights made, then quantized
        gen = torch.Generator().manual_seed(seed)
        self._pool = (torch.randn(self.POOL, generator=gen) * 0.02).to(dtype)
        self._seed = seed
        self._flat: dict[int, tuple[np.ndarray, FlatIndex]] = {}
        self._globals: dict[str, torch.Tensor] | None = None

    @property
    def num_blocks(self) -> int:
        return self.args.num_layers

    def _shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        return block_shapes(self.args, i)  # blocks differ by kind in Qwen3.5 and Gemma 4

    def _fill(self, t: torch.Tensor, name: str, i: int) -> None:
        if "norm" in name or name == "layer_scalar":
            t.fill_(1.0)
            return
        flat, n, P = t.view(-1), t.numel(), self.POOL
        # a stable hash (Python's str hash changes per process): the same weights every run
        o = zlib.crc32(f"{self._seed}/{i}/{name}".encode()) % P
        done = 0
        while done < n:
            k = min(n - done, P - o)
            flat[done : done + k].copy_(self._pool[o : o + k])
            done, o = done + k, 0

    def flat_block(self, i: int) -> tuple[np.ndarray, FlatIndex]:
        """Block i as one flat byte buffer + index (made now if first asked)."""
        if i not in self._flat:
            dname = str(self.dtype).removeprefix("torch.")
            index, size = layout({key: (shape, dname) for key, shape in self._shapes(i).items()})
            buf = np.empty(size, dtype=np.uint8)
            for key, t in unpack(buf, index).items():
                self._fill(t, key, i)
            if self.base_quant != "none":
                buf, index = pack(quant.quantize_block(unpack(buf, index), self.base_quant))
            self._flat[i] = (buf, index)
        return self._flat[i]

    def make_all(self, threads: int | None = None) -> None:
        """Make every block now, `threads` at a time (default: the CPUs, at most 8). The fills
        (torch copies) and the C quantizers release the GIL: a 70B NF4 model's 80 blocks, about
        1 s each to quantize on one core, then take seconds instead of a minute and a half."""
        threads = threads or max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(self.flat_block, range(self.num_blocks)))

    def block(self, i: int) -> dict[str, torch.Tensor]:
        return unpack(*self.flat_block(i))

    def globals(self) -> dict[str, torch.Tensor]:
        if self._globals is None:
            a = self.args
            g = {
                "model.embed_tokens.weight": torch.empty(
                    a.vocab_size, a.hidden_size, dtype=self.dtype
                ),
                "model.norm.weight": torch.empty(a.hidden_size, dtype=self.dtype),
            }
            if not a.tie_word_embeddings:
                g["lm_head.weight"] = torch.empty(a.vocab_size, a.hidden_size, dtype=self.dtype)
            for name, shape in global_shapes(a).items():  # Gemma 4's per-layer embeddings
                g[name] = torch.empty(shape, dtype=self.dtype)
            for name, t in g.items():
                self._fill(t, name, -1)
            self._globals = g
        return self._globals
