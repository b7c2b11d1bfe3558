"""Two data-parallel full fine-tune engines (gloo, CPU fp32) take the steps one engine takes with
the whole batch: each block's fp32 gradients are summed over the group as the block finishes
(FullFinetuneEngine._land), so every rank applies the same AdamW update to every weight."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.engine.blocks import DictBlockSource
from appliance.engine.full import FullFinetuneEngine
from tests.engine.test_data_parallel_engine import global_batches
from tests.helpers_model import make_model
from tests.helpers_net import free_port

LR, EPS = 1e-3, 1e-5  # eps: see tests/engine/test_full_finetune.py


def train(model_dir: Path, mine: list[int], group=None) -> dict:
    engine = FullFinetuneEngine(
        DictBlockSource.from_hf(model_dir, torch.float32),
        weight_decay=0.01,
        eps=EPS,
        grad_clip=0.5,
        group=group,
    )
    losses = []
    for step in range(2):
        mbs = global_batches(step)
        stats = engine.train_step([mbs[m] for m in mine], LR, first=mine[0] if mine else 0)
        losses.append(stats.loss)
    weights = {k: v.clone() for k, v in engine.named_weights().items()}
    engine.close()
    return {"losses": losses, "weights": weights}


def _rank_main(rank: int, port: int, model_dir: Path, shares: list[list[int]], out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(shares)
    )
    try:
        torch.save(train(model_dir, shares[rank], dist.group.WORLD), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_full_finetune_ranks_equal_one_engine_with_the_whole_batch(tmp_path):
    model_dir = make_model(tmp_path / "model", "qwen3-qknorm-tied", with_tokenizer=False)
    single = train(model_dir, [0, 1, 2, 3])
    shares = [[0, 1], [2, 3]]
    mp.spawn(_rank_main, args=(free_port(), model_dir, shares, tmp_path), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-6, atol=0)
        for k, w in single["weights"].items():
            torch.testing.assert_close(got["weights"][k], w, rtol=0, atol=1e-6, msg=k)
