"""What a killed `appliance export` left is cleaned by the next export, never what a live one
holds (issue 44, item 5): a SIGKILLed export left a `.partial-*` directory as big as the merged
model that nothing removed, and a half-uploaded S3 export blocked the next one until cleaned by
hand."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.adapter import export as E
from appliance.cli.main import main
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec
from appliance.storage.output_lock import LOCK_FILE, S3Lease
from tests.helpers_model import lora_with_random_b, make_model

pytest_plugins = ["tests.s3_server"]

# a process that makes an export's scratch directory beside PARENT/merged, writes into it, says
# where, then either is killed there (kill) or lives on (live) until the test ends it
SCRATCH = """
import os, signal, sys, time
from pathlib import Path
from appliance.adapter.scratch import scratch_dir
with scratch_dir(Path(sys.argv[1]), sys.argv[2]) as d:
    (d / "model.safetensors").write_bytes(b"w" * 4096)
    print(d, flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
"""


def scratch(parent: Path, stem: str, how: str) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRATCH), str(parent), stem, how],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return p, Path(p.stdout.readline().strip())


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("ex")
    model = make_model(root / "model", "llama-mha")
    adapter = root / "adapter"
    lora_with_random_b(read_model_args(model), LoraSpec(rank=4, alpha=8.0), seed=1).save(adapter)
    return model, adapter


def export(model, adapter, output) -> tuple[int, str]:
    result = CliRunner().invoke(
        main, ["export", "--model", str(model), "--adapter", str(adapter), "--output", str(output)]
    )
    return result.exit_code, result.output


def test_the_next_export_removes_what_a_killed_one_left_and_not_a_live_ones(
    tmp_path, model_and_adapter
):
    model, adapter = model_and_adapter
    killed, dead = scratch(tmp_path, ".merged.partial", "kill")
    assert killed.wait(timeout=60) == -signal.SIGKILL and dead.is_dir()
    old = tmp_path / f".merged.partial-{killed.pid}-0123abcd"  # an export from before the locks
    old.mkdir()
    live, alive = scratch(tmp_path, ".other.partial", "live")
    try:
        code, text = export(model, adapter, tmp_path / "merged")
        assert code == 0, text
        assert (tmp_path / "merged" / "model.safetensors").is_file()
        assert not dead.exists() and not old.exists()
        assert f"removed {dead}: left by an export that was killed" in text
        assert (alive / "model.safetensors").is_file()  # a live export's: untouched
        assert alive.with_name(alive.name + ".lock").exists()
    finally:
        live.kill()
        live.wait()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == [alive.name, alive.name + ".lock"]  # the live one's, until an export runs


def test_a_killed_s3_export_is_cleaned_by_the_next_and_a_live_one_refuses_it(
    tmp_path, model_and_adapter, s3_bucket, s3_client, monkeypatch
):
    model, adapter = model_and_adapter
    monkeypatch.setenv("APPLIANCE_S3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(S3Lease, "STALE_S", 2.0)
    monkeypatch.setattr(S3Lease, "POLL_S", 0.2)
    monkeypatch.setattr(S3Lease, "RENEW_S", 0.3)
    out = f"s3://{s3_bucket}/merged"
    # what a killed export left: its marker, some weights, its lease (never renewed again)
    for key in (E.EXPORT_MARKER, "model.safetensors", LOCK_FILE):
        s3_client.put_object(Bucket=s3_bucket, Key=f"merged/{key}", Body=b"x")

    with S3Lease(out):  # a live export holds the prefix: refused, nothing of it touched
        code, text = export(model, adapter, out)
        assert code == 1 and "being written by another appliance export" in text, text
        keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
        assert f"merged/{E.EXPORT_MARKER}" in keys and "merged/model.safetensors" in keys

    for key in (E.EXPORT_MARKER, LOCK_FILE):  # killed again: its lease left, not renewed
        s3_client.put_object(Bucket=s3_bucket, Key=f"merged/{key}", Body=b"x")
    code, text = export(model, adapter, out)
    assert code == 0, text
    assert "a killed export's upload" in text
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "merged/config.json" in keys and f"merged/{E.EXPORT_MARKER}" not in keys
    body = s3_client.get_object(Bucket=s3_bucket, Key="merged/model.safetensors")["Body"].read()
    assert body != b"x"  # the merged model's, not the killed export's
    cache = tmp_path / "cache"
    assert not [p for p in cache.iterdir() if p.name.startswith(".export-")]
