"""A run driven the way people drive it: piped output, Ctrl-C and SIGTERM, `--output O --resume`
alone, several runs on one box, a config file beside flags, the umask.

Every run is a real `appliance train` process on embedded Ray. The reference is one uninterrupted
run with its stdout piped (as in `docker logs`): it must print `step N/TOTAL` lines while it
runs. Runs stopped by SIGINT and SIGTERM at a step, then resumed with `--output O --resume` and
nothing else, must finish with the reference's per-step losses.

Each test's runs are a scenario (a function, asserts included) and the module runs them two side
by side (tests/helpers_side.py); the tests at the end wait for theirs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import ModelCard

from appliance.adapter.evaluate import evaluate
from appliance.config import build_config
from appliance.run.record import write_run_file
from appliance.storage.checkpoints import load_latest_checkpoint
from tests.helpers_cli import child_command, cli, finish
from tests.helpers_model import make_model
from tests.helpers_net import free_port
from tests.helpers_ray import session_processes, wait_gone
from tests.helpers_side import ran, selected, side_by_side
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration

STEPS = 40
STOP_AT = 4  # the signal goes in when this step's record is read: many steps are left to run
HUB_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FOUR_CPUS = {"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ux")
    # big enough that a step takes tens of milliseconds: a signal lands well before the end
    model = make_model(
        root / "model", "llama-mha", hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(300, seed=2)))
    return model, data


def train_argv(inputs, output: Path, *extra: str) -> list[str]:
    model, data = inputs
    return [
        *("train", "--model", str(model), "--data", str(data), "--output", str(output)),
        *("--steps", str(STEPS), "--seq-len", "32", "--micro-batch-size", "2"),
        *("--micro-batches-per-step", "2", "--lora-rank", "4", "--lora-dropout", "0.1"),
        *("--lr", "5e-3", "--tokenize-workers", "1"),
        *extra,
    ]


def start(argv: list[str], prefix: str = "", env: dict | None = None) -> subprocess.Popen:
    """`appliance <argv>` with stdout and stderr piped (not a terminal). `prefix`: shell
    commands run before it (`umask 027`); `env`: added to the environment."""
    cmd = [sys.executable, "-m", "appliance", *argv]
    if prefix:
        cmd = ["sh", "-c", f'{prefix}; exec "$@"', "sh", *cmd]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **FOUR_CPUS, **(env or {})},
    )


def read_until(p: subprocess.Popen, pattern: str) -> list[str]:
    """stdout lines up to and including the first that matches `pattern` (while p runs)."""
    lines = []
    for line in p.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r}: {''.join(lines)}{p.stderr.read()[-3000:]}")


def record(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def metrics_port(stderr_or_stdout: str) -> int:
    (port,) = re.findall(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", stderr_or_stdout)
    return int(port)


def scenario_ctrl_c_and_sigterm(inputs, tmp_path: Path) -> None:
    port = free_port()
    ref_out = tmp_path / "ref"
    # the reference: stdout piped, no --log-format, the metrics endpoint scraped while it runs
    ref = start(train_argv(inputs, ref_out, "--metrics-port", str(port)))
    head = read_until(ref, rf"^step 1/{STEPS}  loss ")
    assert ref.poll() is None  # progress shows while the run is going, not at its end
    text = "".join(head)
    assert "starting Ray" in text and "base weights loaded:" in text and "GB/s" in text
    assert "started 1 trainer and 1 tokenizer worker" in text
    assert re.search(r"loss \d+\.\d+ +tok/s [\d,]+ +data-wait \d+% +eta -", head[-1])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200  # the server closes first: its side of the port is in TIME_WAIT
    rc, out, err = finish(ref)
    assert rc == 0, err[-3000:]
    assert "Token authentication is enabled" not in err  # Ray's every-run notice (cluster.py)
    assert re.search(rf"^step {STEPS}/{STEPS} .* eta 0:00:00", out, re.MULTILINE)
    assert [line for line in out.splitlines() if line.startswith("done: ")] == [
        out.splitlines()[-1]
    ]  # one summary line, the last
    reference = record(ref_out)["losses"]
    assert len(reference) == STEPS

    # right after the scraped run, on the same port (SIGINT); beside it a run on the default
    # port (SIGTERM) started as Kubernetes starts its job, with --auto-resume (an empty
    # --output: it starts): both stop at a step boundary with a checkpoint
    stopped = {}
    auto = ("--auto-resume",)
    for sig, extra in ((signal.SIGINT, ("--metrics-port", str(port))), (signal.SIGTERM, auto)):
        out_dir = tmp_path / sig.name
        p = start(train_argv(inputs, out_dir, "--log-format", "json", *extra))
        stopped[sig] = (p, out_dir)

    def stop_at_step(p: subprocess.Popen, sig: signal.Signals) -> None:
        read_until(p, rf'"step": {STOP_AT},')
        p.send_signal(sig)

    # each run is watched by its own thread: a line read late (behind the other run's) would
    # signal a run that may have finished meanwhile
    with ThreadPoolExecutor(len(stopped)) as pool:
        for future in [pool.submit(stop_at_step, p, sig) for sig, (p, _) in stopped.items()]:
            future.result()
    for sig, (p, out_dir) in stopped.items():
        rc, out, err = finish(p)
        assert rc == 130, err[-3000:]  # SIGTERM too: a stop asked for and honoured
        assert "Traceback" not in err
        step = load_latest_checkpoint(str(out_dir)).step
        assert STOP_AT <= step < STEPS
        assert f"interrupted by {sig.name} after step {step}/{STEPS}" in err
        assert f"resume with: {child_command()} train --output {out_dir} --resume" in err
        assert record(out_dir)["status"] == "interrupted"
        assert not (out_dir / "adapter_config.json").exists()

    # a flag that would make it another run: refused, naming both values and the command
    sigint_out = stopped[signal.SIGINT][1]
    rc, _, err = finish(start(["train", "--output", str(sigint_out), "--resume", "--seed", "7"]))
    assert rc == 1 and "Traceback" not in err
    assert "--seed 7 (the run: 0)" in err
    assert (
        f"To continue that run as it was: {child_command()} train --output {sigint_out} --resume"
        in err
    )

    # a finished run resumed with no more --steps: said so, and nothing of it changes, not even
    # the flags run.json and the model card say it trained with (no weight is loaded either);
    # started now, beside the two resumes below, and checked after them
    was, card = record(ref_out), (ref_out / "README.md").read_bytes()
    finished = start(["train", "--output", str(ref_out), "--resume", "--lr", "0.5"])

    # resume both at once (default metrics ports: they must not collide): SIGINT's with --output
    # alone, SIGTERM's with the very command that started it (--auto-resume: a rerun continues)
    resumed = {
        signal.SIGINT: start(
            ["train", "--output", str(sigint_out), "--resume", "--log-format", "json"]
        ),
        signal.SIGTERM: start(
            train_argv(inputs, stopped[signal.SIGTERM][1], "--log-format", "json", *auto)
        ),
    }
    ports = set()
    for sig, p in resumed.items():
        rc, out, err = finish(p)
        assert rc == 0, err[-3000:]
        out_dir = stopped[sig][1]
        assert "resumed from step-" in err
        records = [json.loads(line) for line in out.splitlines()]  # stdout holds JSON only
        steps = [r for r in records if "step" in r]
        first = steps[0]["step"]
        assert first > STOP_AT and steps[-1]["step"] == STEPS
        np.testing.assert_allclose(
            [s["loss"] for s in steps], reference[first - 1 :], rtol=1e-6, atol=0
        )
        done = record(out_dir)
        assert done["status"] == "complete"
        np.testing.assert_allclose(done["losses"], reference, rtol=1e-6, atol=0)
        ports.add(metrics_port(err))
    assert len(ports) == 2 and min(ports) >= 8080

    # the finished run resumed: nothing left to train
    rc, out, err = finish(finished)
    assert rc == 0, err[-3000:]
    assert f"--resume: the run is at step {STEPS}, which --steps {STEPS}" in out
    assert "nothing is left to train" in out and "base weights loaded" not in out + err
    assert record(ref_out) == was and (ref_out / "README.md").read_bytes() == card
    assert was["status"] == "complete" and was["losses"] == reference


def scenario_sigterm_before_the_step_loop(inputs, tmp_path: Path) -> None:
    """`docker stop` while the weights load and the actors start, after Ray started (ray.init
    sets a SIGTERM handler of its own, a silent exit 15, which start_ray replaces with ours
    again): `interrupted`, exit 130, no traceback. Before Ray starts the same handler is in
    force from the executable's first line: in a container the executable is PID 1, which
    ignores a signal it has no handler for (`docker stop` would wait out its timeout)."""
    p = start(train_argv(inputs, tmp_path / "out"))
    read_until(p, "^base weights loaded:")
    p.send_signal(signal.SIGTERM)
    rc, _, err = finish(p, timeout=120)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    assert "interrupted" in err


# SIGTERM delivered at a chosen point inside ray.init: as it creates its node (Ray's own SIGTERM
# handler would be in force by then), or once the node's processes (GCS, raylet) have started,
# before ray.init has recorded them.
SIGTERM_INSIDE_RAY_INIT = """
import os, signal, sys
import ray._private.node as node
def then_sigterm(original):
    def call(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result
    return call
def sigterm_then(original):
    def call(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)
    return call
if sys.argv[1] == "node":
    node.Node.__init__ = sigterm_then(node.Node.__init__)
else:
    node.Node.start_ray_processes = then_sigterm(node.Node.start_ray_processes)
sys.argv = ["appliance", *sys.argv[2:]]
from appliance.__main__ import entry
entry()
"""


def scenario_sigterm_inside_ray_init(inputs, tmp_path: Path, point: str) -> None:
    """ray.init's own SIGTERM handler is a silent sys.exit(15): a SIGTERM while Ray starts
    ended the run with exit 15 and no word, and one that landed after the GCS and raylet had
    started left them running. It is `interrupted`, exit 130, as before and after ray.init,
    and every Ray process is gone with the run."""
    script = tmp_path / "sigterm_inside_ray_init.py"
    script.write_text(SIGTERM_INSIDE_RAY_INIT)
    p = subprocess.Popen(
        [sys.executable, str(script), point, *train_argv(inputs, tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **FOUR_CPUS},
    )
    rc, _, err = finish(p, timeout=120)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.rstrip().endswith("interrupted")
    wait_gone(session_processes(p.pid))  # no GCS or raylet left behind


# The signal delivered while the executable imports torch (appliance.cli imports it, a second or
# more), the moment a Ctrl-C right after Enter lands.
SIGNAL_WHILE_TORCH_IMPORTS = """
import importlib.abc, os, signal, sys
SIGNAL = getattr(signal, sys.argv[1])
class SignalOnTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNAL)
        return None
sys.meta_path.insert(0, SignalOnTorch())
sys.argv = ["appliance", "plan"]
from appliance.__main__ import entry
entry()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_executable_imports_is_interrupted_not_a_traceback(tmp_path, sig):
    """A Ctrl-C in the first second of `appliance train` printed a KeyboardInterrupt traceback
    from inside torch's import: the executable's module imported torch before any handler of
    ours ran. `appliance/__main__.py` imports nothing heavy, so the command ends as a Ctrl-C
    ends it later: `interrupted`, exit 130."""
    script = tmp_path / "signal_while_torch_imports.py"
    script.write_text(SIGNAL_WHILE_TORCH_IMPORTS)
    p = subprocess.run(
        [sys.executable, str(script), sig], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 130, p.stderr[-3000:]
    assert p.stderr.strip() == "interrupted"


def hub_cache(hf_home: Path) -> Path:
    """`HUB_ID` in the layout `hf download` leaves under HF_HOME: the files in blobs/, the
    snapshot directory of a commit linking to them, and refs/main naming that commit."""
    repo = hf_home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = make_model(repo / "snapshots" / COMMIT, "llama-mha")
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\ntags: [base]\n---\nThe base.\n")
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(snapshot.iterdir())):  # files are links to blobs, as there
        blob = repo / "blobs" / f"{i:040x}"
        f.rename(blob)
        f.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def scenario_hub_id_resume(inputs, tmp_path: Path) -> None:
    """One run shows five things: `--model org/name` resolves from the local Hugging Face cache
    (offline) for train, eval and export; `--resume` of a run killed before its first checkpoint
    says so and starts it; `--steps` beside a config file's `epochs` wins, with a note; the files
    written follow the umask; the adapter and the merged model name the base model by its hub id
    (adapter_config.json, the model cards' metadata, with the base card's licence)."""
    snapshot = hub_cache(tmp_path / "hf")
    hub = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    data = inputs[1]
    out = tmp_path / "out"
    # what a run leaves when it is killed before its first checkpoint: run.json alone
    cfg = build_config({}, {"model": str(snapshot), "data": str(data), "output": str(out)})
    cfg.steps, cfg.seq_len, cfg.micro_batch_size, cfg.tokenize_workers = 5, 32, 2, 1
    write_run_file(cfg, "running")
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 3\nwarmup_steps: 1\n")
    argv = ["train", "--model", HUB_ID, "--output", str(out), "--resume"]
    argv += ["--config", str(config), "--steps", "2", "--metrics-port", str(free_port())]
    rc, out_text, err = finish(start(argv, prefix="umask 027", env=hub))
    assert rc == 0, err[-3000:]
    assert f"--resume: {out} has no checkpoint yet" in out_text
    assert "starting that run from step 0" in out_text
    assert f"note: --steps 2 overrides --config {config}: epochs: 3" in err
    done = record(out)
    assert done["status"] == "complete" and len(done["losses"]) == 2
    assert done["config"]["model"] == str(snapshot)  # the hub id, resolved
    assert done["config"]["warmup_steps"] == 1  # the file over the recorded run
    written = [
        out / "adapter_model.safetensors",
        out / "adapter_config.json",
        out / "run.json",
        out / "README.md",
        *(out / "checkpoints").rglob("*.pt"),
    ]
    assert len(written) > 3
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path  # 0666 less the umask 027

    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (HUB_ID, COMMIT)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == HUB_ID and card.data.library_name == "peft"
    assert card.data.license == "apache-2.0" and "base" not in card.data.tags  # licence only
    assert f"| base model | `{HUB_ID}` at {COMMIT[:12]} |" in card.text
    assert f"| data | `{data.name}`, packed by documents |" in card.text
    assert "| steps | 2 (4 micro-batches of 2 × 32 tokens per step; " in card.text

    # the run's model, --seq-len and --dtype go with its adapter
    argv = ["eval", "--adapter", str(out), "--data", str(data), "--device", "cpu"]
    rc, out_text, err = finish(start(argv, env=hub))
    assert rc == 0, err[-3000:]
    assert f"note: --model {snapshot} --seq-len 32 --dtype float32 (from {out}/run.json)" in err
    scored = json.loads(out_text.strip().splitlines()[-1])
    assert scored == evaluate(snapshot, data, 32, adapter_dir=out, with_base=True)
    assert scored["base_loss"] != scored["loss"]  # the base model's loss beside the adapter's
    # an adapter without its run, as PEFT saves one: the hub id and commit it names
    peft = tmp_path / "peft"
    peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / name, peft / name)
    argv = ["export", "--adapter", str(peft), "--output", str(tmp_path / "m-peft")]
    rc, out_text, err = finish(start(argv, env=hub))
    assert rc == 0, err[-3000:]
    assert f"note: --model {HUB_ID}@{COMMIT} (from {peft}/adapter_config.json)" in err
    assert ModelCard.load(tmp_path / "m-peft" / "README.md").data.base_model == HUB_ID

    argv = ["export", "--model", HUB_ID, "--adapter", str(out), "--output", str(tmp_path / "m")]
    rc, out_text, err = finish(start(argv, env=hub))
    assert rc == 0, err[-3000:]
    merged = ModelCard.load(tmp_path / "m" / "README.md")  # the base card is not copied
    assert (merged.data.base_model, merged.data.base_model_relation) == (HUB_ID, "finetune")
    assert merged.data.library_name == "transformers" and merged.data.license == "apache-2.0"
    assert card.text.split("## Training")[1] == merged.text.split("## Training")[1]  # run.json's


def scenario_ray_cannot_start(inputs, tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", "appliance", "train", "--steps", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_TMPDIR": "/proc/no-such-dir", "TMPDIR": str(temp)},
    )
    rc, out, err = finish(p)
    assert rc == 1 and "Traceback" not in out + err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: cannot start Ray: ") and "RAY_TMPDIR" in line
    assert list(temp.glob("appliance-demo-*")) == []  # the demo's model and corpus are gone


def scenario_home_ray_cannot_write(inputs, tmp_path: Path) -> None:
    """`docker run --user <uid>` has HOME=/, which that uid cannot write: Ray 2.60's ray.init,
    with token authentication on by default, failed to save its new token there and did not
    start. /proc stands in for it here (no directory can be made in it, even by root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    argv = train_argv(inputs, tmp_path / "out")
    argv[argv.index("--steps") + 1] = "2"  # a run that starts and completes: its length is moot
    p = cli(*argv, env={**env, **FOUR_CPUS, "HOME": "/proc"})
    rc, out, err = finish(p)
    assert rc == 0, err[-3000:]
    assert record(tmp_path / "out")["status"] == "complete"


# --------------------------------------------------------------------------------- the tests
# The scenarios above are this module's tests, started at once and run three side by side
# (tests/helpers_side.py): each test waits for its own and fails with what it raised.

# longest first (side_by_side); test name -> its scenarios
SCENARIOS = {
    "test_ctrl_c_and_sigterm_checkpoint_and_resume_by_output_alone": {
        "ctrl_c": scenario_ctrl_c_and_sigterm
    },
    "test_a_hub_id_resume_without_checkpoint_flag_over_config_and_umask": {
        "hub_id": scenario_hub_id_resume
    },
    "test_a_home_ray_cannot_write_does_not_stop_the_run": {"home": scenario_home_ray_cannot_write},
    "test_sigterm_before_the_step_loop_stops_at_once_as_ctrl_c_does": {
        "before_loop": scenario_sigterm_before_the_step_loop
    },
    "test_sigterm_inside_ray_init_stops_as_it_does_around_it": {
        f"ray_init_{point}": partial(scenario_sigterm_inside_ray_init, point=point)
        for point in ("node", "processes")
    },
    "test_ray_that_cannot_start_is_one_line_and_the_demo_cleans_up": {
        "no_ray": scenario_ray_cannot_start
    },
}


@pytest.fixture(scope="module", autouse=True)
def scenarios(request, inputs, tmp_path_factory):
    """Started with the module's first test (autouse): the signal tests above, which start no
    Ray, run beside them."""
    tests = selected(request)
    chosen = {
        name: partial(scenario, inputs, tmp_path_factory.mktemp(name))
        for test, named in SCENARIOS.items()
        if test in tests
        for name, scenario in named.items()
    }
    with side_by_side(chosen) as futures:
        yield futures


def test_ctrl_c_and_sigterm_checkpoint_and_resume_by_output_alone(scenarios):
    ran(scenarios, "ctrl_c")


def test_sigterm_before_the_step_loop_stops_at_once_as_ctrl_c_does(scenarios):
    ran(scenarios, "before_loop")


@pytest.mark.parametrize("point", ["node", "processes"])
def test_sigterm_inside_ray_init_stops_as_it_does_around_it(scenarios, point):
    ran(scenarios, f"ray_init_{point}")


def test_a_hub_id_resume_without_checkpoint_flag_over_config_and_umask(scenarios):
    ran(scenarios, "hub_id")


def test_ray_that_cannot_start_is_one_line_and_the_demo_cleans_up(scenarios):
    ran(scenarios, "no_ray")


def test_a_home_ray_cannot_write_does_not_stop_the_run(scenarios):
    ran(scenarios, "home")
