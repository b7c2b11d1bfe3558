"""Embedded Ray's object store is sized from what /dev/shm really holds (less a margin), or by
--object-store-memory, and a model whose weight store cannot fit is refused before Ray starts.

The /dev/shm checks run in a private mount namespace (`unshare --mount`, or as an unprivileged
user `unshare --user --map-root-user --mount`) where a tmpfs of a size chosen here is mounted over
/dev/shm; nothing outside the child process sees it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from appliance.actors.weight_store import WeightStore, weight_store_bytes
from appliance.cluster import start as cluster
from appliance.config import TrainConfig, build_config
from appliance.errors import ConfigError
from appliance.metrics.recorders import RUN_ENV, run_label
from tests.helpers_model import make_model
from tests.helpers_mount import unshare_prefix
from tests.helpers_net import free_port

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024**2
GIB = 1024**3


def with_shm(size: str, python: str, timeout: int = 120) -> dict:
    """Run `python` (which prints one JSON line last) with a fresh tmpfs of `size` on /dev/shm."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"'
    result = subprocess.run(
        [*unshare_prefix(), "sh", "-c", script, sys.executable, textwrap.dedent(python)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# One child process for every case (importing the appliance takes seconds): each mounts a fresh
# tmpfs of its size over /dev/shm (stacked on the last), takes `fill` MiB of it, and sizes.
CASES = {"600m": ("600m", 0), "3g": ("3g", 0), "3g-256m-taken": ("3g", 256), "20m": ("20m", 0)}
SIZES = f"""
    import json, subprocess
    from appliance.cluster.start import object_store_bytes
    from appliance.hardware.host import shm_available_bytes
    from appliance.config import TrainConfig
    out = {{}}
    for name, (size, fill) in {CASES!r}.items():
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", "/dev/shm"], check=True)
        with open("/dev/shm/taken", "wb") as f:
            f.write(bytes(fill * 1024 * 1024))
        out[name] = {{
            "available": shm_available_bytes(),
            "store": object_store_bytes(TrainConfig())[0],
            "override": object_store_bytes(TrainConfig(object_store_memory="300MiB"))[0],
        }}
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sized() -> dict:
    return with_shm("1m", SIZES)


@pytest.mark.parametrize("case", ["600m", "3g", "3g-256m-taken"])
def test_the_object_store_follows_the_tmpfs_on_dev_shm(sized, case) -> None:
    size, fill_mib = CASES[case]
    got = sized[case]
    total = {"600m": 600 * MIB, "3g": 3 * GIB}[size]
    assert got["available"] == total - fill_mib * MIB  # what it really holds, not its size
    margin = min(cluster.SHM_MARGIN_BYTES, got["available"] // 10)
    assert got["store"] == got["available"] - margin  # these tmpfs are far smaller than RAM
    assert got["override"] == 300 * MIB  # --object-store-memory wins


def test_a_dev_shm_as_large_as_ram_leaves_the_processes_a_fifth_of_it(monkeypatch) -> None:
    # /dev/shm on this machine's kind is as large as its RAM: sized to it, Ray refused to start
    shm, ram = 24 * GIB, 20 * GIB
    monkeypatch.setattr(cluster, "shm_available_bytes", lambda _dir: shm)
    monkeypatch.setattr(cluster, "ram_available_bytes", lambda: ram)
    size, source = cluster.object_store_bytes(TrainConfig())
    assert size == int(ram * 0.8) and source == "80% of the 20.0 GiB of RAM available"
    monkeypatch.setattr(cluster, "ram_available_bytes", lambda: 200 * GIB)
    assert cluster.object_store_bytes(TrainConfig()) == (shm - GIB, "/dev/shm holds 24.0 GiB")


def test_a_dev_shm_too_small_for_ray_still_gets_rays_minimum(sized) -> None:
    assert sized["20m"]["store"] == cluster.RAY_MIN_OBJECT_STORE_BYTES


def test_the_weight_store_estimate_is_what_the_store_holds(tmp_path) -> None:
    model = make_model(tmp_path / "m", with_tokenizer=False)
    for dtype in ("float32", "bfloat16"):
        held = WeightStore(model, dtype).handles().nbytes  # no Ray: the real buffers
        assert weight_store_bytes(model, dtype) == held
    held = WeightStore(model, "bfloat16", base_quant="nf4").handles().nbytes
    assert weight_store_bytes(model, "bfloat16", "nf4") == held


def test_a_model_too_big_for_the_object_store_is_refused_with_what_to_do() -> None:
    cluster.check_weights_fit(10 * GIB, 10 * GIB, "--object-store-memory")  # fits exactly
    with pytest.raises(ConfigError) as e:
        cluster.check_weights_fit(68 * GIB, 38 * GIB, "/dev/shm holds 40.0 GiB")
    message = str(e.value)
    assert "need 68.0 GiB of Ray object store, which has 38.0 GiB" in message
    # the size appliance doctor suggests too (doctor.suggested_sizes): 68 GiB and 10 % headroom
    assert "--shm-size=75g" in message and "--object-store-memory" in message


def test_a_bad_object_store_size_is_a_config_error_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--object-store-memory: 'lots' is not a size"):
        build_config({}, {"object_store_memory": "lots"})
    assert build_config({"object_store_memory": "2GiB"}).object_store_memory == "2GiB"


@pytest.mark.integration
def test_embedded_ray_gets_that_store_and_every_worker_the_run_label() -> None:
    """start_ray itself, in the namespace with a 2 GiB tmpfs: Ray's object store is the size
    object_store_bytes gives, and a Ray task sees the run label."""
    got = with_shm(
        "2g",
        f"""
        import json, os, ray
        from appliance.cluster.start import object_store_bytes, start_ray
        from appliance.config import TrainConfig
        from appliance.run.progress import Progress
        cfg = TrainConfig(metrics_port={free_port()}, output="/runs/label-test")
        start_ray(cfg, Progress("plain"), weight_bytes=1024)
        label = ray.get(ray.remote(lambda: os.environ.get("{RUN_ENV}")).remote())
        store = ray.cluster_resources()["object_store_memory"]
        ray.shutdown()
        print(json.dumps({{"store": store, "want": object_store_bytes(cfg)[0], "label": label}}))
        """,
        timeout=240,
    )
    assert got["store"] == pytest.approx(got["want"], rel=0.01)
    assert got["want"] == 2 * GIB - min(cluster.SHM_MARGIN_BYTES, 2 * GIB // 10)  # the tmpfs
    assert got["label"] == run_label("/runs/label-test")


def test_embedded_ray_refuses_before_starting_when_the_weights_cannot_fit(monkeypatch) -> None:
    started = []
    monkeypatch.setattr("ray.init", lambda **kw: started.append(kw))
    cfg = TrainConfig(object_store_memory="1GiB")
    with pytest.raises(ConfigError, match="need 2.0 GiB"):
        cluster.start_ray(cfg, _Quiet(), weight_bytes=2 * GIB)
    assert started == []


class _Quiet:
    def note(self, text: str) -> None:
        pass
