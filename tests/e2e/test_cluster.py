"""`appliance train --cluster` on a real multi-node Ray cluster on this machine: a head, a CPU
node and two trainer nodes; the custom resource `appliance_trainer_node` stands in for a GPU. A
trainer node started in a private mount namespace stands in for one that does not share the
driver's files."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from appliance.cluster.start import TRAINER_NODE_RESOURCE, start_ray
from appliance.config import TrainConfig, build_config
from appliance.errors import ConfigError
from appliance.run.driver import connect
from appliance.run.progress import Progress
from appliance.run.record import write_run_file
from tests.helpers_cli import cli, finish
from tests.helpers_model import make_model
from tests.helpers_mount import unshare_prefix
from tests.helpers_net import free_port
from tests.helpers_ray import node_processes, ray_start, wait_gone
from tests.helpers_side import ran, selected_side_by_side
from tests.helpers_tokenizer import sentences

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def shut_down(c: Cluster) -> None:
    """Stop every node of `c` and wait until their processes are gone (asserted).

    `Cluster.shutdown` leaves the GCS connection it opened for `wait_for_nodes` (its
    `global_state`, a C++ thread named `global.accessor`) running into interpreter exit;
    disconnect it here."""
    procs = node_processes(c.list_all_nodes())  # not the other cluster a test may run beside
    c.shutdown()
    c.global_state.disconnect()
    wait_gone(procs)


@pytest.fixture(scope="module")
def cluster():
    # the head has no CPU and each trainer node one (its trainer's): tokenizer workers can only go
    # to the CPU node, so where they land says that placement follows Ray's resources
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cpu_node = c.add_node(num_cpus=2)
    gpu_nodes = [c.add_node(num_cpus=1, resources={TRAINER_NODE_RESOURCE: 1}) for _ in range(2)]
    c.wait_for_nodes()
    yield c, cpu_node, gpu_nodes
    if ray.is_initialized():
        ray.shutdown()
    shut_down(c)


def test_each_trainer_node_gets_a_store_and_a_trainer_and_the_run_completes(
    cluster, tmp_path, monkeypatch
):
    c, cpu_node, gpu_nodes = cluster
    make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(60)))
    monkeypatch.chdir(tmp_path)  # relative paths: the driver's directory, not the Ray worker's
    cfg = build_config(
        {},
        dict(
            model="model",
            data="data.jsonl",
            output="out",
            steps=4,
            seq_len=16,
            micro_batch_size=2,
            tokenize_workers=2,
            lora_rank=4,
            log_format="json",
            cluster=c.address,
        ),
    )
    try:
        run = connect(cfg, Progress("json"))
        assert (run.cfg.model, run.cfg.output) == (str(tmp_path / "model"), str(tmp_path / "out"))
        write_run_file(run.cfg, "running")
        run.create_actors()
        trainers = ray.get([t.info.remote() for t in run.trainers])
        stores = ray.get([s.stats.remote() for s in run.stores.values()])
        workers = ray.get([w.node_id.remote() for w in run.workers])
        # one trainer per trainer node (by default, with no GPUs), in two processes of a group
        assert sorted(t["node_id"] for t in trainers) == sorted(n.node_id for n in gpu_nodes)
        # each trainer shares memory with its own node's weight store: one store per node
        assert sorted(s["node_id"] for s in stores) == sorted(n.node_id for n in gpu_nodes)
        assert [s["load_count"] for s in stores] == [1, 1]
        # tokenizer workers go where the CPUs are: the trainers took the trainer nodes' only ones
        assert workers == [cpu_node.node_id, cpu_node.node_id]
        state = run.train()
        run.finish()
    finally:
        ray.shutdown()
    assert state.step == 4 and run.num_trainers == 2
    assert state.consumed == 4 * 2 * cfg.micro_batches_per_step  # each step: both ranks' share
    assert (tmp_path / "out" / "adapter_config.json").exists()
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "complete"


def test_a_cluster_without_gpu_nodes_is_refused_by_name(tmp_path):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        model = make_model(tmp_path / "model", "llama-mha")
        data = tmp_path / "d.jsonl"
        data.write_text(json.dumps({"text": "the cat"}) + "\n")
        cfg = build_config(
            {},
            dict(
                model=str(model),
                data=str(data),
                output=str(tmp_path / "o"),
                steps=1,
                cluster=c.address,
            ),
        )
        with pytest.raises(ConfigError, match="no node has a GPU"):
            connect(cfg, Progress("json"))
    finally:
        ray.shutdown()
        shut_down(c)


def cluster_config(tmp_path, **kw):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat"}) + "\n")
    base = dict(model=str(model), data=str(data), output=str(tmp_path / "o"), steps=1)
    return build_config({}, {**base, **kw})


def test_a_local_output_the_driver_cannot_write_is_refused_before_training(cluster, tmp_path):
    c, _, _ = cluster
    (tmp_path / "file").write_text("not a directory")
    cfg = cluster_config(tmp_path, cluster=c.address, output=str(tmp_path / "file" / "out"))
    try:
        with pytest.raises(ConfigError, match="cannot write there from the driver") as e:
            connect(cfg, Progress("json"))
    finally:
        ray.shutdown()
    assert "s3:// URI or a directory shared by the driver and the trainer nodes" in str(e.value)


def test_bare_cluster_joins_the_cluster_named_by_ray_address(cluster, monkeypatch):
    c, _, _ = cluster
    monkeypatch.setenv("RAY_ADDRESS", c.address)
    try:
        start_ray(TrainConfig(cluster="auto"), Progress("json"))
        assert ray.get_runtime_context().gcs_address == c.address
        assert {n["NodeID"] for n in ray.nodes()} >= {n.node_id for n in cluster[2]}
    finally:
        ray.shutdown()


def test_an_address_where_no_cluster_listens_is_one_clear_error():
    with pytest.raises(
        ConfigError, match=r"--cluster 127.0.0.1:1: cannot connect to a Ray cluster"
    ):
        start_ray(TrainConfig(cluster="127.0.0.1:1"), Progress("json"))
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def blind_node(tmp_path_factory):
    """A head (no trainer) and a trainer node started in a private mount namespace, where the
    directory `hidden` is an empty tmpfs and `readonly` is mounted read-only: a node that does
    not share (or cannot write) what the driver's node has there, as a pod without the volume."""
    base = tmp_path_factory.mktemp("blind")
    hidden, readonly = base / "hidden", base / "readonly"
    hidden.mkdir()
    readonly.mkdir()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    mounts = f"mount -t tmpfs tmpfs {hidden} && mount --bind -o ro {readonly} {readonly}"
    args = ["--address", c.address, "--num-cpus", "1"]
    args += ["--resources", json.dumps({TRAINER_NODE_RESOURCE: 1})]
    try:
        prefix = [*unshare_prefix(), "sh", "-c", f'{mounts} && exec "$@"', "sh"]
        with ray_start(args, prefix=prefix) as node:
            c.wait_for_nodes()
            deadline = time.monotonic() + 120
            while len(c.global_state.node_table()) < 2:  # the namespaced node has registered
                assert node.poll() is None, "the namespaced Ray node exited"
                assert time.monotonic() < deadline, "the namespaced Ray node did not join"
                time.sleep(0.5)
            yield c, base
    finally:
        shut_down(c)


@pytest.mark.parametrize(
    ("model", "output", "said"),
    [
        ("model", "hidden/out", "does not see the directory"),
        ("model", "readonly/out", "cannot write there (Read-only file system)"),
        ("hidden/model", "out", "is not visible from the trainer's node"),
    ],
)
def test_a_trainer_node_that_cannot_see_or_write_a_path_is_named_before_training(
    blind_node, model, output, said
):
    c, base = blind_node
    if not (base / model).exists():
        make_model(base / model, "llama-mha")
    data = base / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat"}) + "\n")
    paths = dict(model=str(base / model), data=str(data), output=str(base / output))
    cfg = build_config({}, dict(**paths, steps=1, cluster=c.address))
    try:
        with pytest.raises(ConfigError) as e:
            connect(cfg, Progress("json"))
    finally:
        ray.shutdown()
    assert said in str(e.value)
    assert "s3://" in str(e.value)  # and says what to give instead
    assert not any((base / output).glob(".appliance-probe-*"))  # the probe is gone again


def wait_for_port(address: str, timeout: float = 120.0) -> None:
    """Until host:port accepts a TCP connection (a `ray start` head's GCS)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens at {address}"
            time.sleep(0.2)


def scenario_token_authentication(tmp_path: Path) -> None:
    """The Helm chart's RayCluster uses Ray's token authentication (rayTokenAuth). Without the
    token ray.init retried for 20 s and said only that it could not connect."""
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(40)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    clean.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))  # no ~/.ray/auth_token of this machine
    token = secrets.token_hex(32)
    with_token = {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    other = {"RAY_AUTH_TOKEN": secrets.token_hex(32)}
    gcs = f"127.0.0.1:{free_port()}"
    args = ["--head", "--port", gcs.split(":")[1], "--num-cpus", "2"]
    args += ["--resources", json.dumps({TRAINER_NODE_RESOURCE: 1}), "--include-dashboard", "false"]
    train = ["train", "--cluster", gcs, "--model", str(model), "--data", str(data)]
    train += ["--steps", "2", "--seq-len", "16", "--lora-rank", "4", "--tokenize-workers", "1"]
    tries = {  # three runs at once, each refused: no token sent, a wrong one, none to send
        "none": (clean, "this process sent none, as RAY_AUTH_MODE is not token here: set"),
        "wrong": ({**with_token, **other}, "this process sent one the cluster does not accept"),
        "empty": (  # what the chart's `export ... RAY_AUTH_TOKEN="$(kubectl ...)"` gives when
            {**with_token, "RAY_AUTH_TOKEN": ""},  # kubectl fails: Ray's client aborted on it
            "RAY_AUTH_MODE is token here, but no token is set (RAY_AUTH_TOKEN is empty or unset",
        ),
    }
    with ray_start(args, env=with_token):
        wait_for_port(gcs)
        runs = {k: cli(*train, "--output", str(tmp_path / k), env=e) for k, (e, _) in tries.items()}
        for name, run in runs.items():
            rc, _, err = finish(run)
            assert rc == 1 and "Traceback" not in err, err[-3000:]
            (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
            assert line.startswith(f"error: --cluster {gcs}: cannot connect to a Ray cluster: ")
            assert tries[name][1] in line, line
            assert line.endswith("to the cluster's token" if name == "empty" else "| base64 -d)")
        trained = cli(*train, "--output", str(tmp_path / "out"), env=with_token)
        rc, _, err = finish(trained)
        assert rc == 0, err[-3000:]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "complete"


def scenario_no_gcs_answers(tmp_path: Path) -> None:
    """The dashboard's port (8265) given for the GCS's: ray.init waited about 13 minutes, and
    (SIGTERM and Ctrl-C held while ray.init ran) could not be stopped meanwhile."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat"}) + "\n")
    train = ["train", "--cluster", address, "--model", str(model), "--data", str(data)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Ray's connect timeout shortened from 30 s: the same error, 25 s sooner
    quick = {**env, "RAY_py_gcs_connect_timeout_s": "5"}
    waited = cli(*train, "--output", str(tmp_path / "waited"), env=quick)
    stopped = cli(*train, "--output", str(tmp_path / "stopped"), env=env)
    try:
        # Ray's own line once its client has tried for 5 s: the wait is under way
        said = ""
        while "Failed to connect to GCS at address" not in said:
            line = stopped.stderr.readline()
            assert line, said[-3000:]
            said += line
        stopped.send_signal(signal.SIGINT)
        rc, out, err = finish(stopped, timeout=30)
        assert rc == 130 and "interrupted" in out + err, (out + err)[-3000:]
        rc, out, err = finish(waited)
    finally:
        for p in (waited, stopped):  # a failed assertion leaves neither running
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        server.shutdown()
    assert rc == 1, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert (
        f"--cluster {address}: cannot connect to a Ray cluster: no Ray GCS answered there" in line
    )
    assert "not the dashboard's (8265)" in line


# The last two tests run children only (no Ray in this process): started together, when the
# first of them runs, side by side (tests/helpers_side.py).
SCENARIOS = {  # test -> its scenario, longest first
    "test_a_cluster_with_token_authentication_names_the_token_and_trains_with_it": (
        scenario_token_authentication
    ),
    "test_an_address_where_no_gcs_answers_is_named_and_ctrl_c_ends_the_wait": (
        scenario_no_gcs_answers
    ),
}


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    with selected_side_by_side(request, tmp_path_factory, SCENARIOS) as futures:
        yield futures


def test_a_cluster_with_token_authentication_names_the_token_and_trains_with_it(scenarios):
    ran(scenarios, "test_a_cluster_with_token_authentication_names_the_token_and_trains_with_it")


def test_an_address_where_no_gcs_answers_is_named_and_ctrl_c_ends_the_wait(scenarios):
    ran(scenarios, "test_an_address_where_no_gcs_answers_is_named_and_ctrl_c_ends_the_wait")
