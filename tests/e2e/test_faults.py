"""Crashes lose nothing: exact resume after SIGKILL of the driver, the trainer, a tokenizer worker,
or the driver in the middle of a checkpoint write (CPU, fp32, LoRA dropout on).

Each run is a real `appliance train` process on embedded Ray; the reference is the same run left
alone. After the restore point every run must give the same per-step losses (1e-6) and the same
final adapter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from appliance.storage.checkpoints import list_checkpoints, load_latest_checkpoint
from tests.helpers_model import make_model
from tests.helpers_net import free_port
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

STEPS = 24
EVERY = 8
# Ray's own override: two tokenizer workers and the trainer need 3 CPUs, whatever this machine has
FOUR_CPUS = {"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("faults"))


def build_inputs(root: Path) -> tuple[Path, Path]:
    # big enough that a step takes tens of milliseconds: the kills below land mid-run
    model = make_model(
        root / "model",
        "llama-gqa-rope3-tied",
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
    )
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(400, seed=1)))
    return model, data


def args(inputs, output: Path, *extra: str) -> list[str]:
    model, data = inputs
    return [
        sys.executable,
        "-m",
        "appliance",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(output),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "4",
        "--micro-batches-per-step",
        "2",
        "--lora-rank",
        "4",
        "--lora-dropout",
        "0.1",
        "--lr",
        "5e-3",
        "--tokenize-workers",
        "2",  # two cursors to restore, replayed through the round-robin schedule
        "--log-format",
        "json",
        "--metrics-port",
        str(free_port()),
        *extra,
    ]


class Proc:
    """An `appliance train` process whose JSON step records we read as they come."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **FOUR_CPUS, **(env or {})},
        )
        self.steps: list[dict] = []

    def wait_for_step(self, n: int) -> None:
        for line in self.p.stdout:
            record = json.loads(line)
            if "step" in record:
                self.steps.append(record)
                if record["step"] >= n:
                    return
        raise AssertionError(f"run ended before step {n}: {self.p.stderr.read()[-2000:]}")

    def descendant(self, title: str) -> psutil.Process:
        for child in psutil.Process(self.p.pid).children(recursive=True):
            try:
                if title in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no {title} process under the driver")

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        out, err = self.p.communicate(timeout=timeout)
        return self.p.returncode, out, err

    def kill_all(self) -> None:
        """SIGKILL the driver, then whatever Ray processes it leaves behind."""
        family = psutil.Process(self.p.pid).children(recursive=True)
        self.p.kill()
        self.p.wait()
        _, alive = psutil.wait_procs(family, timeout=1)  # those that end by themselves, at once
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def run_to_end(argv, env=None) -> dict:
    rc, out, err = Proc(argv, env).finish()
    assert rc == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])["summary"]


def run_record(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def adapter(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    run_to_end(args(inputs, out))
    return run_record(out)["losses"], adapter(out)


def assert_same_run(output: Path, reference) -> dict:
    losses, weights = reference
    record = run_record(output)
    assert record["status"] == "complete"
    np.testing.assert_allclose(record["losses"], losses, rtol=1e-6, atol=0)
    got = adapter(output)
    assert got.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(got[k], weights[k], rtol=1e-6, atol=1e-7)
    return record


def test_trainer_killed_mid_run_is_recreated_and_the_run_is_unchanged(inputs, reference, tmp_path):
    out = tmp_path / "out"
    proc = Proc(args(inputs, out))
    proc.wait_for_step(EVERY + 2)
    proc.descendant("ray::Trainer").send_signal(signal.SIGKILL)
    rc, out_text, err = proc.finish()
    assert rc == 0, err[-3000:]
    record = assert_same_run(out, reference)
    assert record["restarts"] == 1
    assert record["weight_store_loads"] == 1  # the new trainer mapped the same weights
    assert "trainer failed" in err
    steps = [json.loads(line) for line in out_text.splitlines() if '"step"' in line]
    assert steps[-1]["step"] == STEPS and steps[-1]["restarts"] == 1  # the JSON log says so


def test_tokenizer_worker_killed_mid_run_resumes_from_its_cursor(inputs, reference, tmp_path):
    """... on the files the run started with: a shard written into its --data directory since,
    sorting before them, would move every document the worker's cursor counts."""
    model, data = inputs
    directory = tmp_path / "data"
    directory.mkdir()
    (directory / "b.jsonl").write_bytes(data.read_bytes())  # the reference's documents
    out = tmp_path / "out"
    proc = Proc(args((model, directory), out))
    proc.wait_for_step(5)
    (directory / "a.jsonl").write_text(json.dumps({"text": "a shard that came later"}) + "\n")
    proc.descendant("ray::ShardWorker").send_signal(signal.SIGKILL)
    rc, _, err = proc.finish()
    assert rc == 0, err[-3000:]
    record = assert_same_run(out, reference)
    assert record["restarts"] == 1
    assert "tokenizer failed" in err


def test_kill_during_checkpoint_write_then_resume_uses_the_previous_checkpoint(
    inputs, reference, tmp_path
):
    out = tmp_path / "out"
    proc = Proc(args(inputs, out), env={"APPLIANCE_FAULT_KILL_DURING_CHECKPOINT": str(2 * EVERY)})
    rc, _, err = proc.finish()
    assert rc == -signal.SIGKILL, err[-3000:]
    # the torn checkpoint is not published; the previous one is intact
    assert load_latest_checkpoint(str(out)).step == EVERY
    assert [c.step for c in list_checkpoints(str(out)) if c.complete] == [EVERY]

    run_to_end(args(inputs, out, "--resume"))
    assert_same_run(out, reference)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(inputs, reference, tmp_path):
    out = tmp_path / "out"
    proc = Proc(args(inputs, out))
    proc.wait_for_step(2 * EVERY + 2)
    proc.kill_all()
    state = out / "checkpoints" / f"step-{2 * EVERY:06d}" / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))

    rc, _, err = Proc(args(inputs, out, "--resume")).finish()
    assert rc == 0, err[-3000:]
    assert "trainer_state.pt" in err and f"resumed from step-{EVERY:06d}" in err
    assert_same_run(out, reference)


def test_too_many_failures_end_the_run_with_the_cause(inputs, tmp_path):
    out = tmp_path / "out"
    proc = Proc(args(inputs, out, "--max-restarts", "0"))
    proc.wait_for_step(3)
    proc.descendant("ray::Trainer").send_signal(signal.SIGKILL)
    rc, _, err = proc.finish()
    assert rc == 1
    assert "giving up after 0 restarts (--max-restarts); last failure (trainer): " in err
    assert "The actor died" in err  # the cause, from Ray
    assert "Traceback" not in err
    assert not (out / "adapter_config.json").exists()  # no adapter that looks complete


def test_driver_killed_then_resumed_reproduces_the_uninterrupted_run(inputs, reference, tmp_path):
    """... and a resume of it with a changed config is refused first, naming the flag (once
    test_resume_refuses_a_changed_config_naming_the_flag, which killed a run of its own for
    it): the refusals leave the run as it was, and the resume then reproduces the reference."""
    out = tmp_path / "out"
    proc = Proc(args(inputs, out))
    proc.wait_for_step(EVERY + 3)  # past the first checkpoint
    proc.kill_all()
    assert load_latest_checkpoint(str(out)).step == EVERY
    assert run_record(out)["status"] == "running"

    rc, _, err = Proc(args(inputs, out, "--resume", "--lora-rank", "8")).finish()
    assert rc == 1
    assert "--lora-rank" in err and "Traceback" not in err
    # the checkpoint's data cursors are per worker: another worker count would not resume it
    rc, _, err = Proc(args(inputs, out, "--resume", "--tokenize-workers", "1")).finish()
    assert rc == 1 and "Traceback" not in err
    assert "was trained with --tokenize-workers 2" in err

    summary = run_to_end(args(inputs, out, "--resume"))
    assert summary["steps"] == STEPS
    assert_same_run(out, reference)


def test_a_one_cpu_machine_is_refused_without_blaming_an_unpassed_flag(inputs, tmp_path):
    argv = args(inputs, tmp_path / "out")
    i = argv.index("--tokenize-workers")
    del argv[i : i + 2]  # the default worker count
    rc, _, err = Proc(argv, env={"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 1})}).finish()
    assert rc == 1 and "Traceback" not in err
    assert "training needs at least 2 CPUs" in err and "Ray has 1" in err
    assert "--tokenize-workers" not in err
