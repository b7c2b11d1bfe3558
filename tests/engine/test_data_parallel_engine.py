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

from appliance.engine.blocks import DictBlockSource
from appliance.engine.loss_scale import LossScaler
from appliance.engine.step import StreamedEngine
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


def train(
    model_dir: Path, shares: list[list[int]], rank: int, group=None, fp16_steps: int = 0
) -> dict:
    """STEPS train steps on micro-batches `shares[rank]` (consecutive indexes) of each global
    batch, with LoRA dropout. `fp16_steps`: that many steps in float16 instead, from a loss
    scale (2**24) that overflows, so the first steps are skipped."""
    dtype = torch.float16 if fp16_steps else torch.float32
    source = DictBlockSource.from_hf(model_dir, dtype)
    lora = lora_with_random_b(source.args, SPEC_WITH_DROPOUT)
    engine = StreamedEngine(
        source,
        lora,
        dtype=dtype,
        weight_decay=0.01,
        grad_clip=0.5,
        group=group,
        loss_scaler=LossScaler(2.0**24) if fp16_steps else None,
    )
    mine = shares[rank]
    losses, targets, scales = [], [], []
    for step in range(fp16_steps or STEPS):
        mbs = global_batches(step)
        first = mine[0] if mine else 0
        lr = LRS[step % len(LRS)]
        stats = engine.train_step([mbs[m] for m in mine], lr, first=first)
        losses.append(stats.loss)
        targets.append(stats.target_tokens)
        scales.append((stats.loss_scale, stats.skipped_step))
    params = [p.detach().clone() for p in engine.lora.parameters()]
    return {"losses": losses, "targets": targets, "params": params, "scales": scales}


def _rank_main(
    rank: int, port: int, model_dir: Path, shares: list[list[int]], out: Path, fp16_steps: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(shares)
    )
    try:
        result = train(model_dir, shares, rank, dist.group.WORLD, fp16_steps)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_data_parallel(
    model_dir: Path, shares: list[list[int]], out: Path, fp16_steps: int = 0
) -> list[dict]:
    port = free_port()
    args = (port, model_dir, shares, out, fp16_steps)
    mp.spawn(_rank_main, args=args, nprocs=len(shares), join=True)
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


def test_in_fp16_every_rank_skips_the_steps_whose_global_gradient_overflowed(tmp_path):
    """The overflow check comes after the all-reduce: a rank with no micro-batches (finite, zero
    gradients of its own) skips the same steps as the rank whose backward overflowed, with the
    same scale, and both end where one engine with the whole batch ends."""
    model_dir = make_model(tmp_path / "model", "llama-mha", with_tokenizer=False)
    single = train(model_dir, [[0, 1]], rank=0, fp16_steps=8)
    ranks = run_data_parallel(model_dir, [[0, 1], []], tmp_path, fp16_steps=8)
    assert single["scales"][0] == (2.0**24, True)
    assert not all(skipped for _, skipped in single["scales"])  # some steps went through
    for r in ranks:
        assert r["scales"] == single["scales"]
        torch.testing.assert_close(r["losses"], single["losses"], rtol=0, atol=0)
        for p, q in zip(r["params"], single["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


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
