"""A run whose S3 lease was taken over stops writing, says so and exits non-zero (issue 44, item
4): it only logged it and kept writing and pruning checkpoints beside the new owner."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from appliance.storage.output_lock import LOCK_FILE
from tests.helpers_model import make_model
from tests.helpers_net import free_port
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration
pytest_plugins = ["tests.s3_server"]


def test_a_run_whose_lease_is_taken_over_stops_writing(tmp_path, s3_bucket, s3_client):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(100)))
    out = f"s3://{s3_bucket}/run"
    env = {**os.environ, "APPLIANCE_LEASE_RENEW_S": "0.5",
           "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})}  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "appliance", "train", "--model", str(model), "--data", str(data),
         "--output", out, "--steps", "3000", "--checkpoint-every", "5", "--seq-len", "16",
         "--micro-batch-size", "2", "--tokenize-workers", "1", "--metrics-port",
         str(free_port()), "--log-format", "plain"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=env,
    )  # fmt: skip
    try:
        seen = ""
        for line in p.stdout:
            seen += line
            if re.match(r"^step 10/3000 ", line):
                break
        # another driver takes the lease over (as one does after 45 s without a renewal)
        taker = b"4242 on another-host\nrenewal 0\n"
        s3_client.put_object(Bucket=s3_bucket, Key=f"run/{LOCK_FILE}", Body=taker)
        rest, _ = p.communicate(timeout=300)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    text = seen + rest
    assert p.returncode == 1, text[-3000:]
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "lease was taken over" in errors[0], text[-3000:]
    assert "stopped writing there" in errors[0]
    lease = s3_client.get_object(Bucket=s3_bucket, Key=f"run/{LOCK_FILE}")["Body"].read()
    assert lease == taker  # the new owner's lease: not deleted, not rewritten
    record = json.loads(s3_client.get_object(Bucket=s3_bucket, Key="run/run.json")["Body"].read())
    assert record["status"] == "running"  # not rewritten (failed, complete) beside the new owner
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "run/adapter_config.json" not in keys
