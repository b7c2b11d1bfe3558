"""FullTrainer and the weight store's writable home, as plain classes (no Ray): trainers share
the home's weights, a checkpoint round-trips the model (sharded, as transformers loads it) and the
optimizer exactly, a restart before any checkpoint puts the base weights back, a checkpoint and
the final model are written (and a checkpoint read) a file at a time, a damaged optimizer part
sends the restore to the previous checkpoint, and a checkpoint that is not this model's full
fine-tune is refused in one line."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance.actors.full_trainer import INDEX, FullTrainer
from appliance.actors.trainer import Trainer, TrainerSettings
from appliance.actors.weight_store import WeightStore
from appliance.storage.checkpoints import CheckpointError, list_checkpoints
from tests.helpers_model import SPEC, batch, make_model

pytest_plugins = ["tests.s3_server"]


def settings(model_dir, **kw) -> TrainerSettings:
    return TrainerSettings(lora=SPEC, model=str(model_dir), weight_decay=0.01, **kw)


def micro_batches(seed: int):
    ids, labels = batch(4, 16, seed=seed)
    return [(ids[:2], labels[:2]), (ids[2:], labels[2:])]


@pytest.fixture
def model_dir(tmp_path):
    return make_model(tmp_path / "model", "qwen3-qknorm-tied")


def test_trainers_share_the_home_and_a_checkpoint_restores_the_run_exactly(model_dir, tmp_path):
    store = WeightStore(model_dir, "float32", writable=True)
    handles = store.handles()
    assert handles.home is not None and os.path.exists(handles.home)
    a = FullTrainer(handles, settings(model_dir))
    a.engine.train_step(micro_batches(0), 1e-3)
    a.shard_bytes = 100_000  # several shards, as a big model writes them
    a.save_checkpoint(str(tmp_path / "out"), 1, {}, keep=2)
    ckpt_model = tmp_path / "out" / "checkpoints" / "step-000001" / "model"
    assert (ckpt_model / INDEX).is_file()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt_model, dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, a.engine.named_weights()[name]), name

    # a second trainer on the same store maps the same pages: it sees the update
    b = FullTrainer(handles, settings(model_dir))
    wa, wb = a.engine.named_weights(), b.engine.named_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the trainer that died is recreated from the checkpoint: the next step is the same
    a_stats = a.engine.train_step(micro_batches(1), 1e-3)
    after_a = {k: v.clone() for k, v in a.engine.named_weights().items()}
    c = FullTrainer(handles, settings(model_dir))
    assert c.restore_latest_checkpoint(str(tmp_path / "out"))["name"] == "step-000001"
    assert c.engine.step_count == 1
    assert c.engine.train_step(micro_batches(1), 1e-3).loss == a_stats.loss
    after_c = c.engine.named_weights()
    assert all(torch.equal(after_a[k], after_c[k]) for k in after_a)

    # with no checkpoint (a trainer that died before the first), the base weights come back
    d = FullTrainer(handles, settings(model_dir))
    assert d.restore_latest_checkpoint(str(tmp_path / "empty")) is None
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, p in base.named_parameters():
        assert torch.equal(d.engine.named_weights()[name], p), name
    store.close()
    assert not os.path.exists(handles.home)


def peak_bytes(fn) -> int:
    """The most Python-allocated memory (bytes objects, buffers, arrays) `fn()` held at once."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_checkpoint_and_the_model_are_written_a_file_at_a_time(tmp_path):
    """... the weights as views of the home, the optimizer a part at a time: what the writer
    holds at once is about one part's state, not the checkpoint (several times that here)."""
    model_dir = make_model(tmp_path / "model", "qwen3-qknorm-tied", num_hidden_layers=6)
    store = WeightStore(model_dir, "float32", writable=True)
    a = FullTrainer(store.handles(), settings(model_dir))
    a.shard_bytes = 100_000  # two shards a block
    a.engine.train_step(micro_batches(0), 1e-3)
    out = tmp_path / "out"
    saving = peak_bytes(lambda: a.save_checkpoint(str(out), 1, {}, keep=2))
    final = peak_bytes(lambda: a.write_adapter(str(out)))

    files = [p for p in (out / "checkpoints" / "step-000001").rglob("*") if p.is_file()]
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in files}
    part = max(n for name, n in sizes.items() if "/optimizer/" in name)  # one block's
    assert sum(n for name, n in sizes.items() if "model-000" in name) > 6 * 100_000
    assert saving < 2 * part and 4 * saving < sum(sizes.values())
    assert final < 100_000  # the shards are views of the home: nothing of them is copied

    # the model loads as transformers' own, the state restores bit-exactly (reading the
    # optimizer a part at a time as well), and the next step is the same
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    weights = a.engine.named_weights()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, weights[name]), name
    expected = a.engine.train_step(micro_batches(1), 1e-3)
    after = {k: v.clone() for k, v in a.engine.named_weights().items()}
    b = FullTrainer(store.handles(), settings(model_dir))
    assert peak_bytes(lambda: b.restore_latest_checkpoint(str(out))) < 2 * part
    assert b.engine.train_step(micro_batches(1), 1e-3).loss == expected.loss
    assert all(torch.equal(v, after[k]) for k, v in b.engine.named_weights().items())

    # a damaged part: the restore falls back to the previous checkpoint, naming the file
    a.save_checkpoint(str(out), 2, {}, keep=2)
    bad = Path(list_checkpoints(str(out))[-1].uri) / "optimizer" / "3.pt"
    bad.write_bytes(bad.read_bytes()[:-1] + b"x")
    c = FullTrainer(store.handles(), settings(model_dir))
    found = c.restore_latest_checkpoint(str(out))
    assert found["name"] == "step-000001" and c.engine.step_count == 1
    assert any("optimizer/3.pt" in p and "corrupt" in p for p in found["skipped"])
    store.close()


def test_another_models_or_a_lora_runs_state_is_refused_in_one_line(model_dir, tmp_path):
    other = make_model(tmp_path / "other", "qwen3-qknorm-tied", intermediate_size=96)
    shallow = make_model(tmp_path / "shallow", "qwen3-qknorm-tied", num_hidden_layers=2)
    # (a store owns its home: it is kept while its trainers map it)
    stores = [WeightStore(d, "float32", writable=True) for d in (model_dir, other, shallow)]
    mine = FullTrainer(stores[0].handles(), settings(model_dir))
    theirs = FullTrainer(stores[1].handles(), settings(other))
    with pytest.raises(CheckpointError, match=r"^--resume: part 0: mlp\.\w+\.weight is shape .*"
                       r"another model's; resume with the model it trained$"):  # fmt: skip
        mine.load_state_bytes([theirs.state_bytes(), *theirs.part_bytes()])
    fewer = FullTrainer(stores[2].handles(), settings(shallow))
    with pytest.raises(CheckpointError, match=r"^--resume: the optimizer state has 3 parts, "
                       r"this model 4: it is another model's; resume with the model it trained$"):  # fmt: skip
        mine.load_state_bytes([fewer.state_bytes(), *fewer.part_bytes()])
    lora = Trainer(WeightStore(model_dir, "float32").handles(), settings(model_dir))
    with pytest.raises(CheckpointError, match="LoRA run's .* --finetuning-type lora$"):
        mine.load_state_bytes(lora.state_bytes())


def test_a_full_checkpoint_and_model_on_s3_restore_exactly(model_dir, s3_bucket):
    from appliance.storage import uri as storage

    out = f"s3://{s3_bucket}/runs/full"
    store = WeightStore(model_dir, "float32", writable=True)
    a = FullTrainer(store.handles(), settings(model_dir))
    a.shard_bytes = 100_000
    a.engine.train_step(micro_batches(0), 1e-3)
    a.save_checkpoint(out, 1, {}, keep=2)
    a.write_adapter(out)
    top = [n for n in storage.list_files(out) if "/" not in n]
    assert "config.json" in top and INDEX in top and "tokenizer.json" in top
    expected = a.engine.train_step(micro_batches(1), 1e-3).loss
    b = FullTrainer(store.handles(), settings(model_dir))
    assert b.restore_latest_checkpoint(out)["name"] == "step-000001"
    assert b.engine.train_step(micro_batches(1), 1e-3).loss == expected
    store.close()


def test_a_streamed_shard_reads_back_with_safetensors_in_every_trained_dtype():
    from safetensors.torch import load

    from appliance.actors.full_files import safetensors_chunks

    tensors = {
        "a": torch.randn(3, 5).bfloat16(),
        "b": torch.randn(7).half(),
        "c": torch.randn(2, 2)[:, 0],  # not contiguous: copied, alone
        "d": torch.zeros(0, 4),
    }
    back = load(b"".join(bytes(c) for c in safetensors_chunks(tensors)))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
