"""The WeightStore as a Ray actor: threads read, convert and put the blocks side by side, reusing
their buffers; what lands in the object store is the same as the store keeps without Ray."""

from __future__ import annotations

import pytest
import ray
import torch

from appliance.weight_store import WeightStore, local_source
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
