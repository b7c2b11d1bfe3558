"""Two data-parallel engines (gloo, CPU fp32) take the same steps as one engine with the whole batch.

Each rank passes its share of the global batch; target tokens, LoRA gradients and the loss are
summed over the group, so both ranks end with the single engine's parameters (1e-5 relative).
LoRA dropout is on: a micro-batch's masks follow its index in the global batch, so any split
over ranks draws the masks the single engine draws.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.blocks import DictBlockSource
from appliance.engine import StreamedEngine
from tests.helpers_model import SPEC, batch, lora_with_random_b, make_model
from tests.helpers_net import free_port

RTOL = 1e-5
SPEC_WITH_DROPOUT = dataclasses.replace(SPEC, dropout=0.2)
STEPS = 2
LRS = (1e-2, 5e-3)


def global_batches(step: int) -> list:
    """The step's 4 micro-batches of 2 rows; uneven target counts, so normalisation is global."""
    ids, labels = batch(8, 12, seed=20 + step)
    labels[3, :] = -100
    return [(ids[i : i + 2], labels[i : i + 2]) for i in range(0, 8, 2)]


def train(model_dir: Path, shares: list[list[int]], rank: int, group=None) -> dict:
    """STEPS train steps on micro-batches `shares[rank]` (consecutive indexes) of each global
    batch, with LoRA dropout."""
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args, SPEC_WITH_DROPOUT)
    engine = StreamedEngine(source, lora, weight_decay=0.01, grad_clip=0.5, group=group)
    mine = shares[rank]
    losses, targets = [], []
    for step in range(STEPS):
        mbs = global_batches(step)
        first = mine[0] if mine else 0
        stats = engine.train_step([mbs[m] for m in mine], LRS[step], first=first)
        losses.append(stats.loss)
        targets.append(stats.target_tokens)
    params = [p.detach().clone() for p in engine.lora.parameters()]
    return {"losses": losses, "targets": targets, "params": params}


def _rank_main(rank: int, port: int, model_dir: Path, shares: list[list[int]], out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(shares)
    )
    try:
        torch.save(train(model_dir, shares, rank, dist.group.WORLD), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_data_parallel(model_dir: Path, shares: list[list[int]], out: Path) -> list[dict]:
    port = free_port()
    mp.spawn(_rank_main, args=(port, model_dir, shares, out), nprocs=len(shares), join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(len(shares))]


def assert_same_training(ranks: list[dict], single: dict) -> None:
    for r in ranks:
        torch.testing.assert_close(r["losses"], single["losses"], rtol=RTOL, atol=0)
        assert r["targets"] == single["targets"]
        # Parameters after AdamW: summing gradients in another order changes their last bits, and
        # Adam divides each by its own running magnitude, so an element whose gradient is near
        # zero (dropout makes some) moves by up to lr·(rounding)/|g|. Bound that at 0.1% of the
        # largest step (lr = 1e-2); the losses above hold the training itself to 1e-5 relative.
        for p, q in zip(r["params"], single["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-3 * max(LRS))


def test_two_ranks_with_two_micro_batches_each_equal_one_engine_with_all_four(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha", with_tokenizer=False)
    single = train(model_dir, [[0, 1, 2, 3]], rank=0)
    ranks = run_data_parallel(model_dir, [[0, 1], [2, 3]], tmp_path)
    assert single["losses"][0] != single["losses"][1]  # the adapter moved
    assert_same_training(ranks, single)


def test_a_rank_without_micro_batches_joins_and_adds_nothing(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha", with_tokenizer=False)
    single = train(model_dir, [[0, 1]], rank=0)
    ranks = run_data_parallel(model_dir, [[0, 1], []], tmp_path)
    assert_same_training(ranks, single)


def test_without_the_global_index_a_share_would_draw_other_dropout_masks(tmp_path):
    """The control for the tests above: the same share numbered from 0 instead of its global
    index 2 trains differently, so matching the single engine depends on the global index."""
    model_dir = make_model(tmp_path / "model", "llama-mha", with_tokenizer=False)
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    share = global_batches(0)[2:]
    losses = []
    for first in (2, 0):
        engine = StreamedEngine(source, lora_with_random_b(source.args, SPEC_WITH_DROPOUT))
        losses.append(engine.train_step(share, LRS[0], first=first).loss)
    assert losses[0] != losses[1]
