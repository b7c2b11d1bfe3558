"""Ray: start it embedded, or join --cluster; where the trainers go; checks that need the cluster.

- `start_ray`: embedded Ray (address="local", metrics on --metrics-port, its object store sized
  to what /dev/shm holds: `object_store_bytes`; a model that cannot fit is refused first), or
  ray.init of --cluster (bare: $RAY_ADDRESS). Either way every process of the job gets the run's
  metrics label (recorders.RUN_ENV).
- `trainer_slots`: one slot per trainer a --cluster can host: each GPU of a trainer node (a node
  with the appliance_trainer_node resource, else any GPU node), one per trainer node without GPUs.
- `check_shared_output`: with --cluster the driver writes run.json and rank 0, on a trainer node,
  the checkpoints and the adapter: a local --output must be writable from the driver and be the
  same directory, writable too, on the trainer nodes.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appliance.cluster import auth
from appliance.config import DEFAULT_METRICS_PORT, TrainConfig, parse_bytes
from appliance.errors import ApplianceError, ConfigError, first_line
from appliance.hardware.host import (
    SHM_DIR,
    ram_available_bytes,
    shm_available_bytes,
)
from appliance.interrupt import sigterm_stops_at_once
from appliance.metrics.endpoint import (
    EVERY_INTERFACE,
    choose_metrics_port,
    metrics_bound_to,
    metrics_url,
    ray_init_kwargs,
)
from appliance.metrics.recorders import RUN_ENV, run_label, set_run_label
from appliance.storage import uri as storage
from appliance.storage.checkpoints import FAULT_ENV, FAULT_PID_ENV

TRAINER_NODE_RESOURCE = "appliance_trainer_node"  # marks nodes for trainers, beside "GPU"

GIB = 1024**3
#: Left free in /dev/shm beside the object store (NCCL's and torch's shared-memory segments):
#: 1 GiB, or a tenth of a smaller /dev/shm.
SHM_MARGIN_BYTES = GIB
#: Ray refuses a smaller object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES).
RAY_MIN_OBJECT_STORE_BYTES = 75 * 1024**2
#: Share of the RAM available at start left to processes (trainers, tokenizer workers, Ray's
#: own) when /dev/shm is as large as RAM itself (a default tmpfs is half of RAM, some hosts'
#: all of it): a store sized to /dev/shm alone would leave them nothing, and Ray refuses to
#: start when the store leaves tasks under 5% of RAM.
RAM_RESERVE_FRACTION = 0.2


class Notes(Protocol):
    """What start_ray says as it goes (run/progress.Progress is one)."""

    def note(self, text: str) -> None: ...


@dataclass(frozen=True)
class Slot:
    """Where one trainer goes: a node (None = wherever Ray puts it, embedded) and its address."""

    node_id: str | None
    address: str | None = None


def object_store_bytes(cfg: TrainConfig, shm_dir: str = SHM_DIR) -> tuple[int | None, str]:
    """The embedded Ray object store's size in bytes and where it came from.

    --object-store-memory when given; else what /dev/shm holds now less a margin
    (SHM_MARGIN_BYTES, or a tenth of a small /dev/shm) and at most 80% of the RAM available
    (RAM_RESERVE_FRACTION), never under Ray's minimum. Ray's own
    default is 30% of RAM, capped by /dev/shm: `docker run --shm-size=100g` on a 128 GiB host got a
    38 GiB store, and a 34B or 70B weight store spilled to disk. None (Ray's default) where there
    is no /dev/shm (macOS).
    """
    if cfg.object_store_memory is not None:
        return parse_bytes(cfg.object_store_memory), "--object-store-memory"
    available = shm_available_bytes(shm_dir)
    if available is None:
        return None, "Ray's default (no /dev/shm)"
    margin = min(SHM_MARGIN_BYTES, available // 10)
    size, source = available - margin, f"{shm_dir} holds {available / GIB:.1f} GiB"
    ram = ram_available_bytes()
    ram_cap = int(ram * (1 - RAM_RESERVE_FRACTION))
    if ram_cap < size:
        size = ram_cap
        source = f"{1 - RAM_RESERVE_FRACTION:.0%} of the {ram / GIB:.1f} GiB of RAM available"
    return max(size, RAY_MIN_OBJECT_STORE_BYTES), source


def check_weights_fit(weight_bytes: int, store_bytes: int, source: str) -> None:
    """Refuse, before loading anything, a weight store larger than the object store: Ray would
    spill it to disk and every step would stream the model from there."""
    if weight_bytes <= store_bytes:
        return
    need = weight_bytes / GIB
    raise ConfigError(
        f"the model's weights need {need:.1f} GiB of Ray object store, which has "
        f"{store_bytes / GIB:.1f} GiB ({source}): give /dev/shm more (docker run "
        f"--shm-size={shm_gib_for(weight_bytes)}g; Kubernetes: a bigger memory-backed /dev/shm) "
        "or set --object-store-memory"
    )


def shm_gib_for(weight_bytes: float) -> int:
    """The /dev/shm size, in whole GiB, whose object store holds a weight store of `weight_bytes`
    with 10 % headroom (and at least the margin object_store_bytes keeps back): the one number
    every `--shm-size` suggestion gives (this check, appliance doctor)."""
    return math.ceil(max(weight_bytes * 1.1, weight_bytes + SHM_MARGIN_BYTES) / GIB)


def start_ray(cfg: TrainConfig, progress: Notes, weight_bytes: int | None = None) -> None:
    """Embedded Ray (address="local", metrics on --metrics-port, the object store sized by
    `object_store_bytes`), or join --cluster. `weight_bytes` (embedded Ray: the model's weight
    store, `weight_store_bytes`) is checked against the object store before Ray starts."""
    import ray

    if ray.is_initialized():
        return

    ours = sigterm_stops_at_once()  # then _init_ray keeps it through ray.init

    # Every process of this job (trainers, tokenizer workers, the weight store) labels its
    # metrics with the run: the Ray session is shared by every RayJob on a cluster.
    label = run_label(cfg.output)
    set_run_label(label)
    env_vars = {RUN_ENV: label}
    if os.environ.get(FAULT_ENV):  # tests: rank 0 kills this driver too when it writes
        env_vars.update({FAULT_ENV: os.environ[FAULT_ENV], FAULT_PID_ENV: str(os.getpid())})
    runtime_env = {"env_vars": env_vars}

    if cfg.cluster:
        from ray.exceptions import AuthenticationError

        address = cfg.cluster
        if address == "auto":
            address = os.environ.get("RAY_ADDRESS") or "auto"
        try:
            problem = auth.local_token_problem()
            if problem:  # Ray's client would abort this process on it
                raise ConnectionError(f"{problem}: {auth.HOW}")
            _reachable(address)
            _answers_as_gcs(address)
            _init_ray(
                ours,
                starts_ray=False,
                address=address,
                log_to_driver=False,
                runtime_env=runtime_env,
            )
        except ConnectionError as e:
            raise ConfigError(
                f"--cluster {address}: cannot connect to a Ray cluster: {e}"
            ) from None
        except AuthenticationError as e:  # ray.init's own check ("auto": no probe above)
            raise ConfigError(
                f"--cluster {address}: cannot connect to a Ray cluster: {first_line(e)}; {auth.HOW}"
            ) from None
        progress.note(f"connected to Ray cluster at {address}")
    else:
        port = choose_metrics_port(cfg.metrics_port, DEFAULT_METRICS_PORT)
        store, source = object_store_bytes(cfg)
        if store is not None and weight_bytes is not None:
            check_weights_fit(weight_bytes, store, source)
        progress.note("starting Ray (embedded)")
        auth.quiet_default_notice()
        auth.token_in_env_if_home_is_read_only()
        t0 = time.perf_counter()
        try:
            with metrics_bound_to(cfg.metrics_host):  # loopback unless --metrics-host 0.0.0.0
                _init_ray(
                    ours,
                    starts_ray=True,
                    address="local",
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level=logging.WARNING,  # Ray's own INFO lines stay out of the log
                    object_store_memory=store,
                    runtime_env=runtime_env,
                    **ray_init_kwargs(port),
                )
        except ApplianceError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever Ray raised, the user gets one line
            if ray.is_initialized():
                ray.shutdown()
            ray_dir = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")
            raise RayStartFailed(
                f"cannot start Ray: {first_line(e)}; check that {ray_dir} and /dev/shm have "
                "free space and are writable (RAY_TMPDIR moves the first), then see the logs in "
                f"{ray_dir}/session_latest/logs"
            ) from None
        progress.note(f"Ray ready in {time.perf_counter() - t0:.1f} s")
        if store is not None:
            progress.note(f"object store: {store / GIB:.1f} GiB ({source})")
        every = " (listening on every interface)" if cfg.metrics_host == EVERY_INTERFACE else ""
        progress.note(f"metrics: {metrics_url(port)}{every}")


def _init_ray(stop_at_once: bool, starts_ray: bool, **kwargs) -> None:
    """`ray.init(**kwargs)`, where SIGTERM and Ctrl-C stop as they do before and after it.

    ray.init installs a SIGTERM handler of its own first thing, a silent `sys.exit(15)`: a
    SIGTERM while Ray started ended the run with exit 15 and no word. With our stop-at-once
    handler in force (`stop_at_once`), Ray's is not installed. And a signal that lands inside a
    ray.init that starts Ray (`starts_ray`), whatever the handler, interrupts it halfway: after
    it has started the GCS and the raylet but before it has recorded them, so ray.shutdown()
    cannot stop them, and they outlive the run. So there both signals are held while ray.init
    runs and acted on once it has returned: ray.shutdown(), then KeyboardInterrupt
    (`interrupted`, exit 130). A ray.init that joins a cluster starts no process, and can wait
    for minutes on one that does not answer: there they act at once."""
    import ray

    if not stop_at_once or threading.current_thread() is not threading.main_thread():
        ray.init(**kwargs)
        return
    from ray._private import utils as ray_utils

    asked: list[int] = []
    signals = (signal.SIGTERM, signal.SIGINT) if starts_ray else ()
    previous = {s: signal.signal(s, lambda signum, frame: asked.append(signum)) for s in signals}
    ray_sets_its_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        ray.init(**kwargs)
    finally:
        ray_utils.set_sigterm_handler = ray_sets_its_handler
        for s, handler in previous.items():
            signal.signal(s, handler)
    if asked:
        ray.shutdown()
        raise KeyboardInterrupt


class RayStartFailed(ApplianceError):
    """The embedded Ray did not start (no space for its session files or shared memory, ...)."""


def _answers_as_gcs(address: str) -> None:
    """Raise ConnectionError, saying why, unless a Ray GCS at host:port accepts this process: one
    connection (Ray's own GcsClient), in a thread, so that Ctrl-C and SIGTERM act meanwhile.

    ray.init retries it 20 times and then says only that it could not connect: about 20 s for a
    cluster that wants an auth token this process lacks, about 13 minutes for an address where
    something else answers (the dashboard's port, 8265, given for the GCS's)."""
    if _host_port(address) is None:
        return
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError, RpcError
    except ImportError:  # another Ray than the pinned one: ray.init alone says what it says
        return
    failed: list[BaseException] = []

    def connect() -> None:
        try:
            GcsClient(address=address)
        except Exception as e:  # noqa: BLE001 - handed to the main thread
            failed.append(e)

    probe = threading.Thread(target=connect, name="appliance-gcs-probe", daemon=True)
    start = time.monotonic()
    probe.start()
    while probe.is_alive():
        probe.join(0.2)  # signal handlers run between these
    if not failed:
        return
    e = failed[0]
    if isinstance(e, AuthenticationError):
        raise ConnectionError(
            f"it uses Ray's token authentication, and this process sent "
            f"{auth.what_was_sent()}: {auth.HOW} (the Helm chart's: "
            f"{auth.CHART_TOKEN})"
        ) from None
    if isinstance(e, RpcError):
        raise ConnectionError(
            f"no Ray GCS answered there within {time.monotonic() - start:.0f} s "
            f"({first_line(e)}): give the head's GCS port (6379 unless `ray start --head "
            "--port` chose another), not the dashboard's (8265); a head that is still starting: "
            "try again once it is up"
        ) from None


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a host:port --cluster address; None for "auto" (Ray looks for a local
    cluster itself) or a ray:// client address, which the checks before ray.init leave alone."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    return host, int(port)


def _reachable(address: str, timeout: float = 10.0) -> None:
    """Raise ConnectionError unless host:port accepts a TCP connection: ray.init retries an
    address where nothing listens for minutes."""
    host_port = _host_port(address)
    if host_port is None:
        return
    try:
        socket.create_connection(host_port, timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address} ({e.strerror or e})") from None


def trainer_slots() -> list[Slot]:
    """Every trainer the connected cluster can host, node by node (sorted by address, so the
    placement is deterministic): the nodes with the appliance_trainer_node resource (set on GPU
    pods by the Helm chart), else the GPU nodes; a node gives one slot per GPU, one without GPUs
    (a CPU trainer node) one slot."""
    import ray

    nodes = sorted(
        (n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"]
    )
    for key in (TRAINER_NODE_RESOURCE, "GPU"):
        marked = [n for n in nodes if n["Resources"].get(key, 0) > 0]
        if marked:
            return [
                Slot(n["NodeID"], n["NodeManagerAddress"])
                for n in marked
                for _ in range(max(1, int(n["Resources"].get("GPU", 0))))
            ]
    raise ConfigError(
        f"--cluster: no node has a GPU (or the {TRAINER_NODE_RESOURCE} resource); "
        "add a GPU worker group to the cluster"
    )


def local_slots(device: str, trainers: int | None) -> list[Slot]:
    """Embedded Ray: one slot per GPU Ray sees on CUDA; on CPU as many as asked (default 1)."""
    import ray

    if device == "cuda":
        return [Slot(None)] * int(ray.cluster_resources().get("GPU", 0))
    return [Slot(None)] * (trainers or 1)


def on_node(node_id: str | None) -> dict:
    """Ray options that pin an actor or task to `node_id` (none when it is None)."""
    if node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _output_problem(probe: str) -> str | None:
    """On a trainer node: None when it sees the driver's probe file and can write and remove a
    file beside it (rank 0 writes the checkpoints and the adapter there, and prunes the old
    checkpoints), else what is wrong."""
    seen = Path(probe)
    try:
        seen.stat()
    except FileNotFoundError:
        return "does not see the directory (the driver's file written there is not there)"
    except OSError as e:
        return f"cannot read the directory ({e.strerror})"
    mine = seen.with_name(f"{seen.name}-{socket.gethostname()}-{os.getpid()}")
    try:
        mine.write_bytes(b"")
    except OSError as e:
        return f"cannot write there ({e.strerror})"
    try:
        mine.unlink()
    except OSError as e:
        return f"can write there but not remove a file it wrote, {mine.name} ({e.strerror})"
    return None


def check_shared_output(output: str, slots: list[Slot]) -> None:
    """A local --output with --cluster: create it here (the driver writes into it), then check
    that every trainer node sees the same directory (by a probe file written here) and can write
    into it."""
    if storage.is_s3(output):
        return
    import ray

    shared = (
        "with --cluster the driver writes run.json and rank 0 the checkpoints and the adapter: "
        "give an s3:// URI or a directory shared by the driver and the trainer nodes"
    )
    probe = Path(output) / f".appliance-probe-{uuid.uuid4().hex}"
    try:
        Path(output).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as e:
        raise ConfigError(
            f"--output {output}: cannot write there from the driver ({e.strerror}); {shared}"
        ) from None
    try:
        nodes = sorted({(s.node_id, s.address) for s in slots if s.node_id is not None})
        check = ray.remote(num_cpus=0)(_output_problem)
        problems = ray.get([check.options(**on_node(n)).remote(str(probe)) for n, _ in nodes])
    finally:
        probe.unlink(missing_ok=True)
    wrong = [f"{address} {why}" for (_, address), why in zip(nodes, problems, strict=True) if why]
    if wrong:
        raise ConfigError(
            f"--output {output}: from the trainer node(s): {'; '.join(wrong)}; {shared}"
        )
