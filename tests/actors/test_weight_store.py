"""The WeightStore as a Ray actor: threads read, convert and put the blocks side by side, reusing
their buffers; what lands in the object store is the same as the store keeps without Ray."""

from __future__ import annotations

import pytest
import ray
import torch

from appliance.actors.weight_store import WeightStore, local_source
from tests.helpers_model import make_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 5 blocks and 2 threads: buffers are reused by later blocks while others are being put
    root = tmp_path_factory.mktemp("ws")
    return make_model(root / "m", "llama-gqa-rope3-tied", with_tokenizer=False, num_hidden_layers=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # as stored (fp32), and converted
def test_the_store_actor_holds_the_same_weights_as_the_store_without_ray(
    ray_local, model_dir, dtype
):
    store = ray.remote(num_cpus=0)(WeightStore).remote(str(model_dir), dtype, "none", 2)
    try:
        remote = ray.get(store.handles.remote()).source()  # zero-copy views of shared memory
    finally:
        ray.kill(store)
    local = local_source(model_dir, dtype)
    assert remote.globals().keys() == local.globals().keys()
    for name, t in local.globals().items():
        assert torch.equal(remote.globals()[name], t), name
    assert remote.num_blocks == local.num_blocks == 5
    for i in range(local.num_blocks):
        a, b = remote.block(i), local.block(i)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype == getattr(torch, dtype), name
            assert torch.equal(a[name], b[name]), (i, name)


@pytest.mark.parametrize(
    "dtype, hidden, from_file",
    [
        ("float32", 64, 6),  # blocks 0, 1, 3, 4, the embeddings and the final norm
        ("float32", 40, 1),  # a norm of 160 bytes is padded to 192 in a buffer: assembled
        ("bfloat16", 64, 0),  # converted from fp32: assembled
    ],
)
def test_blocks_put_from_the_files_pages_and_blocks_assembled_both_hold_the_files_values(
    tmp_path, dtype, hidden, from_file
):
    """Re-sharded so that blocks 0, 1, 3 and 4 each lie back to back in one file (put from the
    mapped file as they lie, where the layout is the file's) and block 2 straddles both files
    (assembled): every tensor equals the files' own."""
    import json

    from safetensors.torch import load_file, save_file

    from appliance.models import hf_checkpoint

    model = make_model(
        tmp_path / "m",
        "llama-gqa-rope3-tied",
        with_tokenizer=False,
        num_hidden_layers=5,
        hidden_size=hidden,
    )
    whole = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    first = {n for n in whole if not n.startswith(("model.layers.3.", "model.layers.4."))}
    first -= {n for n in whole if n.startswith("model.layers.2.self_attn.")}
    shards = {"a.safetensors": sorted(first), "b.safetensors": sorted(set(whole) - first)}
    for fname, names in shards.items():
        save_file({n: whole[n] for n in names}, model / fname, metadata={"format": "pt"})
    weight_map = {n: f for f, names in shards.items() for n in names}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    locs = hf_checkpoint.tensor_locations(hf_checkpoint.SafetensorsCheckpoint(model))
    files = {}
    for i in range(5):
        files[i] = {loc.path for n, loc in locs.items() if n.startswith(f"model.layers.{i}.")}
    assert [len(files[i]) for i in range(5)] == [1, 1, 2, 1, 1]
    expected = {}
    for f in model.glob("*.safetensors"):
        expected.update(load_file(f))
    loader = WeightStore(model, dtype)
    store = loader.handles().source()
    assert loader.buffers_from_file == from_file
    for name, t in store.globals().items():
        assert torch.equal(t, expected[name].to(t.dtype)), name
    for i in range(store.num_blocks):
        for short, t in store.block(i).items():
            want = expected[f"model.layers.{i}.{short}"]
            assert t.dtype == getattr(torch, dtype)
            assert torch.equal(t, want.to(t.dtype)), (i, short)


def test_a_tensor_past_the_end_of_its_file_names_the_file(tmp_path):
    from appliance.actors.weight_store import _map
    from appliance.errors import ModelError

    short = tmp_path / "model.safetensors"
    short.write_bytes(b"\0" * 5000)
    assert _map(short, 4000, 1000).tolist() == [0] * 1000
    with pytest.raises(ModelError, match=r"model\.safetensors.*truncated"):
        _map(short, 4000, 1001)


def test_the_load_bench_row_counts_the_buffers_put_from_the_files(ray_local, tmp_path):
    """`appliance bench --load`'s store row, with Ray: the store's bytes, and how many buffers
    went straight from the files' pages (here a bf16 checkpoint kept in bf16: the embeddings and
    the norm at least; a block only where it lies in one shard)."""
    from appliance.bench.load import (
        LLAMA_1B,
        driver_loads,
        format_table,
        store_load,
        write_checkpoint,
    )

    small = {**LLAMA_1B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
    small.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    write_checkpoint(tmp_path / "m", small, shard_bytes=40_000)
    row = store_load(tmp_path / "m", "none", 2)
    driver = driver_loads(tmp_path / "m", "none", 2, loads=2)
    assert len(driver["seconds_each"]) == 2 and driver["seconds"] == driver["seconds_each"][1]
    assert driver["store_bytes"] == row["store_bytes"]
    assert row["store_bytes"] == WeightStore(tmp_path / "m", "bfloat16").handles().nbytes
    assert row["buffers"] == 2 + 2  # embeddings (tied), final norm, two blocks
    assert 2 <= row["buffers_from_file"] <= 4
    result = {
        "model": "m",
        "checkpoint_bytes": row["store_bytes"],
        "cpus": 2,
        "load_average": (0.0, 0.0, 0.0),
        "read": {"seconds": 1.0, "gb_per_second": 1.0},
        "store": [{**row, "object_store": "cold", "gb_per_second": 1.0, "ratio_to_read": 1.0}],
        "driver": {**driver, "gb_per_second": 1.0, "ratio_to_read": 1.0},
        "kernels": [],
    }
    table = format_table(result)
    assert f"| {row['buffers_from_file']}/4 |" in table
    assert "| WeightStore in the driver, --base-quant none (median of loads 2...2" in table


def test_the_load_bench_refuses_one_load_in_the_driver(capsys):
    from appliance.bench.load import main

    assert main(["--in-driver", "1"]) == 1
    assert "--in-driver 1: 0 (none) or at least 2 loads" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_the_store_names_the_first_weight_that_is_not_finite(tmp_path, bad):
    """Asked when a step's loss is not finite: the run's error names the weight (it sent the
    user to `appliance doctor`, which reads no weight), or, all finite, points at the data and
    --lr."""
    from safetensors.torch import load_file, save_file

    model = make_model(tmp_path / "m", "llama-mha", with_tokenizer=False)
    assert WeightStore(model).first_non_finite() is None
    weights = load_file(model / "model.safetensors")
    weights[bad].view(-1)[-1] = float("inf")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert WeightStore(model).first_non_finite() == bad
