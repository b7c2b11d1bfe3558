"""Data-parallel trainers through the real driver (embedded Ray, CPU, gloo).

Two trainers taking M micro-batches each are one trainer taking 2M: same per-step losses (1e-5
relative) and the same adapter, each trainer in its own process.
"""

from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from appliance.run.inputs import prepare
from appliance.run.loop import Run
from appliance.run.progress import Progress
from tests.helpers_model import make_model, tiny_train_config
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

M = 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    model = make_model(root / "model", "llama-gqa-rope3-tied")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(70, seed=5)))
    return model, data


def run(inputs, output, trainer_class=None, **kw) -> tuple[Run, list[int]]:
    """A run through the driver's Run; returns it (actors stopped) and its trainers' pids."""
    model, data = inputs
    cfg = tiny_train_config(model, data, output, **kw)
    r = Run(prepare(cfg), Progress("json"))
    r.trainer_class = trainer_class or r.trainer_class
    r.create_actors()
    pids = [ray.get(t.info.remote())["pid"] for t in r.trainers]
    r.train()
    r.finish()
    r.stop()  # the next run needs the CPUs
    return r, pids


def assert_same_training(a, b, out_a, out_b) -> None:
    np.testing.assert_allclose(a.state.losses, b.state.losses, rtol=1e-5, atol=0)
    assert a.state.target_tokens == b.state.target_tokens
    wa, wb = (
        load_file(out_a / "adapter_model.safetensors"),
        load_file(out_b / "adapter_model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    # AdamW amplifies the rounding of near-zero gradient elements summed in another order (see
    # tests/engine/test_data_parallel_engine.py): 0.1% of the step size (lr 1e-2) bounds it
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-5)


# with LoRA dropout: rank 1's micro-batches draw the masks of their global-batch index
STEPS = dict(steps=5, lora_dropout=0.1)


@pytest.fixture(scope="module")
def two_trainers(ray_local, inputs, tmp_path_factory):
    """(run, its trainers' pids, its output): two trainers taking M micro-batches each, 5 steps,
    left alone; the reference of the tests below that change one thing about it."""
    out = tmp_path_factory.mktemp("dp-two") / "two"
    two, pids = run(inputs, out, trainers=2, micro_batches_per_step=M, **STEPS)
    return two, pids, out


def test_two_trainers_with_m_micro_batches_train_like_one_with_2m(
    ray_local, inputs, two_trainers, tmp_path
):
    two, pids, two_out = two_trainers
    one, _ = run(inputs, tmp_path / "one", trainers=1, micro_batches_per_step=2 * M, **STEPS)

    assert len(set(pids)) == 2 and os.getpid() not in pids  # a process per trainer
    assert two.state.step == one.state.step == 5
    assert two.state.consumed == 5 * 2 * M
    assert_same_training(two, one, two_out, tmp_path / "one")
    record = json.loads((two_out / "run.json").read_text())
    assert record["config"]["trainers"] == 2 and record["weight_store_loads"] == 1
    assert record["kernels"] == "exact"  # the tier that ran: auto on a CPU is exact


def test_an_epoch_whose_last_step_leaves_a_rank_without_batches(ray_local, inputs, tmp_path):
    m = 4  # the data makes 17 micro-batches: 2 steps of 2×4, then 1 for rank 0 and none for 1
    two, _ = run(inputs, tmp_path / "two", epochs=1, trainers=2, micro_batches_per_step=m)
    one, _ = run(inputs, tmp_path / "one", epochs=1, trainers=1, micro_batches_per_step=2 * m)

    total = sum(two.counts)
    assert 0 < total % (2 * m) <= m
    assert two.total_steps == one.total_steps == math.ceil(total / (2 * m))
    assert two.state.consumed == one.state.consumed == total  # every batch once
    assert_same_training(two, one, tmp_path / "two", tmp_path / "one")


def test_a_dead_rank_restarts_every_trainer_in_a_fresh_group_and_the_run_is_unchanged(
    ray_local, inputs, two_trainers, tmp_path
):
    from appliance.actors.trainer import Trainer

    marker = tmp_path / "rank1-killed"

    class Rank1DiesOnce(Trainer):
        def step(self, batches, lr, first=0):
            if self.rank == 1 and self.engine.step_count == 3 and not marker.exists():
                marker.touch()  # past the checkpoint at step 2; rank 0 is in the collective
                os.kill(os.getpid(), signal.SIGKILL)
            return super().step(batches, lr, first)

    ref, _, ref_out = two_trainers  # the same run, left alone
    died, _ = run(
        inputs,
        tmp_path / "died",
        trainers=2,
        micro_batches_per_step=M,
        checkpoint_every=2,
        trainer_class=Rank1DiesOnce,
        **STEPS,
    )
    assert marker.exists() and died.restarts == 1
    assert_same_training(died, ref, tmp_path / "died", ref_out)


def test_two_full_finetune_trainers_train_like_one_through_a_restart(ray_local, inputs, tmp_path):
    """--finetuning-type full: each rank keeps its own fp32 masters over the node's one shared
    home of weights, the gradients are all-reduced block by block, and rank 0 writes the model.
    Rank 1 dies once past the checkpoint of step 2: rank 0 reads the checkpoint a part at a
    time and hands rank 1 the parts through the object store; the run is unchanged."""
    from appliance.actors.full_trainer import FullTrainer

    marker = tmp_path / "rank1-killed"

    class Rank1DiesOnce(FullTrainer):
        def step(self, batches, lr, first=0):
            if self.rank == 1 and self.engine.step_count == 3 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return super().step(batches, lr, first)

    full = dict(finetuning_type="full", steps=4, checkpoint_every=2, lr=1e-3)
    two, pids = run(
        inputs,
        tmp_path / "two",
        trainers=2,
        micro_batches_per_step=M,
        trainer_class=Rank1DiesOnce,
        **full,
    )
    one, _ = run(inputs, tmp_path / "one", trainers=1, micro_batches_per_step=2 * M, **full)

    assert marker.exists() and two.restarts == 1 and len(set(pids)) == 2
    assert two.state.step == one.state.step == 4
    np.testing.assert_allclose(two.state.losses, one.state.losses, rtol=1e-6, atol=0)
    assert two.state.losses[-1] < two.state.losses[0]
    wa = load_file(tmp_path / "two" / "model.safetensors")
    wb = load_file(tmp_path / "one" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    record = json.loads((tmp_path / "two" / "run.json").read_text())
    assert record["config"]["trainers"] == 2 and record["weight_store_loads"] == 1
    assert record["kernels"] == "exact"  # a full fine-tune without compiled blocks
