"""Every name that comes from outside is checked to stay inside its root (issue 44, item 2): an
S3 key with `../` below an `s3://` --data prefix was downloaded outside the S3 cache, and
stale-file cleanup deleted by the same names; a checkpoint manifest, a safetensors index or a
hub path could name a file outside theirs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from appliance.errors import DataError, ModelError, StorageError
from appliance.models.hf_checkpoint import SafetensorsCheckpoint
from appliance.storage.checkpoints import (
    MANIFEST,
    load_latest_checkpoint,
    save_checkpoint,
)
from appliance.storage.localize import localize
from appliance.storage.names import inside, why_outside
from tests.helpers_model import make_model

pytest_plugins = ["tests.s3_server"]


def test_why_outside_names_each_way_out():
    assert why_outside("a/b.jsonl") is None and why_outside("a//./b") is None
    assert "'..'" in why_outside("a/../../x")
    assert "absolute" in why_outside("/etc/passwd")
    assert "NUL" in why_outside("a\0b")
    with pytest.raises(ValueError, match="would leave"):
        inside(Path("/tmp/x"), "../y")


def test_an_s3_key_with_dotdot_is_not_written_outside_the_cache(tmp_path, s3_bucket, s3_client):
    cache = tmp_path / "cache"
    victim = tmp_path / "victim.txt"  # where `../` leads from the cache's copy of the prefix
    victim.write_text("the user's file")
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "a"}\n')
    s3_client.put_object(Bucket=s3_bucket, Key="data/../../../victim.txt", Body=b"pwned")
    with pytest.raises(StorageError) as e:
        localize(f"s3://{s3_bucket}/data", cache)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert "data/../../../victim.txt" in message and "leads out of the S3 cache" in message
    assert victim.read_text() == "the user's file"
    assert not any(p.read_bytes() == b"pwned" for p in tmp_path.rglob("*") if p.is_file())


def test_stale_cleanup_never_deletes_outside_the_cache(tmp_path, s3_bucket, s3_client):
    """A cache index (written by appliance, then tampered with, or an older run's) that names a
    file outside the cache: the stale-file cleanup deletes nothing there."""
    cache = tmp_path / "cache"
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "a"}\n')
    dest = localize(f"s3://{s3_bucket}/data", cache)
    index_path = cache / ".etags" / s3_bucket / "data.json"
    index = json.loads(index_path.read_text())
    index["../../../victim.txt"] = {"size": 1, "etag": "x"}
    index_path.write_text(json.dumps(index))
    assert localize(f"s3://{s3_bucket}/data", cache) == dest
    assert victim.read_text() == "the user's file"
    assert "../../../victim.txt" not in json.loads(index_path.read_text())


def test_a_manifest_naming_a_file_outside_its_checkpoint_is_not_trusted(tmp_path):
    out = tmp_path / "run"
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"s")
    save_checkpoint(str(out), 1, {"a.bin": b"one"}, keep=3)
    step2 = Path(save_checkpoint(str(out), 2, {"a.bin": b"two"}, keep=3))
    manifest = json.loads((step2 / MANIFEST).read_text())
    manifest["files"].append(
        {"name": "../../../secret.bin", "size": 1, "sha256": hashlib.sha256(b"s").hexdigest()}
    )
    (step2 / MANIFEST).write_text(json.dumps(manifest))
    ckpt = load_latest_checkpoint(str(out))
    assert ckpt is not None and ckpt.step == 1  # falls back, as for a corrupt one
    assert any("outside the checkpoint" in p for p in ckpt.skipped), ckpt.skipped
    assert outside.read_bytes() == b"s"


def test_a_safetensors_index_naming_a_shard_outside_the_model_is_refused(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha", shards=True)
    index_path = Path(model) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere/model.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"names the shard '../elsewhere/model.safetensors'"):
        SafetensorsCheckpoint(model)


def test_hub_paths_stay_in_the_snapshot():
    from appliance.data.listing import resolve_dataset
    from appliance.storage.hub import resolve_model

    with pytest.raises(DataError, match="leaves the dataset repo"):
        resolve_dataset("org/name/../../../*.jsonl")
    with pytest.raises(ModelError, match="is not a branch, tag or commit"):
        resolve_model("org/name@../../../../tmp")
