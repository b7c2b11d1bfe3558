"""`python -m appliance.cluster.jobstop`, the Kubernetes pods' preStop hook, against a real Ray head with
its dashboard and job API: `appliance train --cluster auto` submitted as a Ray job (as the chart's
RayJob submits it) is stopped the way a pod deletion stops it, finishes its step, writes a
checkpoint and ends STOPPED; a job that outlasts the timeout is named, with exit status 1."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from appliance.cluster.start import TRAINER_NODE_RESOURCE
from appliance.storage.checkpoints import load_latest_checkpoint
from tests.helpers_model import make_model
from tests.helpers_net import free_port
from tests.helpers_ray import ray_session, ray_start
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration


def jobstop(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cluster.jobstop", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def wait_for(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def submit(client, entrypoint: str, timeout: float = 180.0) -> str:
    """`client.submit_job`, again while the head answers that its job agent has not registered
    yet (HTTP 500 "No available agent"): the dashboard serves before the agent is up, which on a
    loaded 2-core machine can take a while after ray.init returns."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_a_dashboard_that_does_not_answer_means_nothing_to_stop() -> None:
    done = jobstop("--address", f"http://127.0.0.1:{free_port()}", "--timeout", "5")
    assert done.returncode == 0, done.stderr
    assert "no Ray dashboard answers at http://127.0.0.1:" in done.stdout


def test_a_training_job_stops_at_a_step_with_a_checkpoint_and_a_stubborn_one_is_named(
    tmp_path: Path, monkeypatch
) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    model = make_model(
        tmp_path / "model", "llama-mha", hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(300, seed=2)))
    output = tmp_path / "out"
    # the chart sets this in the head's environment; the job supervisor (a Ray worker on the
    # head) inherits it from the raylet that ray.init starts here
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "120")
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    with ray_session(
        num_cpus=4,
        resources={TRAINER_NODE_RESOURCE: 1},
        include_dashboard=True,
        dashboard_port=port,
        log_to_driver=False,
    ):
        client = JobSubmissionClient(address)
        train = [
            *(sys.executable, "-m", "appliance", "train", "--cluster", "auto"),
            *("--model", str(model), "--data", str(data), "--output", str(output)),
            *("--steps", "100000", "--seq-len", "32", "--micro-batch-size", "2"),
            *("--lora-rank", "4", "--tokenize-workers", "1", "--log-format", "json"),
        ]
        job = submit(client, subprocess.list2cmdline(train))
        wait_for(lambda: '"step": 3,' in client.get_job_logs(job), "step 3 of the job")

        done = jobstop("--address", address)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"job {job}: RUNNING; stopping it" in done.stdout
        assert f"job {job}: ended after" in done.stdout
        assert client.get_job_status(job) == JobStatus.STOPPED
        logs = client.get_job_logs(job)
        step = load_latest_checkpoint(str(output)).step
        assert 3 <= step < 100000, logs[-3000:]
        assert f"interrupted by SIGTERM after step {step}/100000" in logs, logs[-3000:]
        assert json.loads((output / "run.json").read_text())["status"] == "interrupted"

        # a job that takes longer to stop than the timeout: named, exit status 1. It ends once
        # the test lets it (a file appears), not after a sleep: it is stubborn until then
        stubborn, release = tmp_path / "stubborn.py", tmp_path / "release"
        stubborn.write_text(
            "import os, signal, sys, time\n"
            "def stop(*args):\n"
            f"    while not os.path.exists({str(release)!r}):\n"
            "        time.sleep(0.1)\n"
            "    sys.exit(130)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n"
        )
        slow = submit(client, f"{sys.executable} {stubborn}")
        wait_for(lambda: "ready" in client.get_job_logs(slow), "the stubborn job to start")
        late = jobstop("--address", address, "--timeout", "5", "--say-every", "1")
        assert late.returncode == 1, late.stdout + late.stderr
        assert f"waiting for {slow} (" in late.stdout  # a line while it waits
        assert f"still running after 5 s: {slow} (" in late.stdout
        assert "no submitted job is running" not in late.stdout
        release.touch()
        wait_for(lambda: client.get_job_status(slow).is_terminal(), "the stubborn job to end")
        again = jobstop("--address", address)
        assert (
            again.returncode == 0 and "no submitted job is running on the cluster" in again.stdout
        )


def test_a_head_with_token_authentication_needs_its_token(tmp_path: Path) -> None:
    """KubeRay's `authOptions: {mode: token}` (the chart's rayTokenAuth) puts RAY_AUTH_MODE and
    RAY_AUTH_TOKEN in every Ray container, so the pods' hooks have the token. Without it (run
    from elsewhere) the head refuses, and jobstop says so: exit 2, not a traceback, and never
    "nothing to stop"."""
    token = secrets.token_hex(32)
    port, gcs = free_port(), free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    clean["HOME"] = str(tmp_path)  # no ~/.ray/auth_token of this machine's
    args = ["--head", "--port", str(gcs), "--num-cpus", "1", "--include-dashboard", "true"]
    args += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(port)]
    address = f"http://127.0.0.1:{port}"
    with ray_start(args, env={**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}):
        wait_for(lambda: _answers(address), "the head's dashboard")
        refused = jobstop("--address", address, env=clean)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr
        assert (
            f"the Ray dashboard at {address} uses Ray's token authentication and refused this "
            "process, which sent none, as RAY_AUTH_MODE is not token here: set RAY_AUTH_MODE="
        ) in refused.stdout
        # RAY_AUTH_MODE=token and no token: Ray's client refuses before it asks the dashboard
        empty = jobstop("--address", address, env={**clean, "RAY_AUTH_MODE": "token"})
        assert empty.returncode == 2, empty.stdout + empty.stderr
        assert "RAY_AUTH_MODE is token here, but no token is set" in empty.stdout
        assert "Traceback" not in empty.stdout + empty.stderr
        with_token = {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        done = jobstop("--address", address, env=with_token)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "no submitted job is running on the cluster" in done.stdout


def _answers(address: str) -> bool:
    try:
        urllib.request.urlopen(f"{address}/api/version", timeout=5).close()
    except urllib.error.HTTPError:
        return True  # it answered (401: it wants the token)
    except OSError:
        return False
    return True
