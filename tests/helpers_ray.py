"""Ray started in the test process, and proof that it is gone again afterwards.

Every fixture that starts Ray here goes through `ray_session` (or `SharedRay`, the one Ray of
conftest's `ray_local`, or `node_processes` and `wait_gone` around a `ray.cluster_utils.Cluster`'s
shutdown): it shuts Ray down, waits for the processes Ray started (GCS, raylet,
agents, workers: descendants of this process) to exit, and fails the test if any is left. A Ray
process outliving its test keeps CPUs busy under the next test and, left until interpreter exit,
is one of the ways a green suite ends in a crash (issue 17).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil

# ray.shutdown() asks Ray's processes to end and waits for them; workers notice their raylet is
# gone a moment later. Generous: on a loaded 2-core machine a worker can take seconds to exit.
EXIT_WAIT_S = 60.0


def ray_descendants() -> list[psutil.Process]:
    """The Ray processes this process started and that are still alive (not zombies).

    Workers are re-parented when their raylet dies, so this is taken while Ray is up and the
    list is checked afterwards by `wait_gone`.
    """
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and _is_ray(child):
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


#: Ray's own processes that carry a `ray::` title: not a test's actors
RAY_AGENTS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def actor_processes() -> list[psutil.Process]:
    """This process's Ray workers that host an actor or run a task (`ray::<Class>` titles)."""
    found = []
    for p in ray_descendants():
        try:
            name = " ".join(p.cmdline()) or p.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("ray::") and not name.startswith(RAY_AGENTS):
            found.append(p)
    return found


def node_processes(nodes) -> list[psutil.Process]:
    """The processes of `ray.cluster_utils.Cluster` nodes (GCS, raylet, agents) and their
    descendants (the workers): only those nodes', whatever else runs beside them."""
    procs = []
    for node in nodes:
        for infos in node.all_processes.values():
            for info in infos:
                try:
                    top = psutil.Process(info.process.pid)
                    procs += [top, *top.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
    return procs


def session_processes(sid: int) -> list[psutil.Process]:
    """The processes of session `sid` (a CLI run started with start_new_session: its driver and
    every Ray process it spawned, however re-parented), except zombies."""
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return procs


def _is_ray(p: psutil.Process) -> bool:
    cmd = " ".join(p.cmdline())
    return "ray" in cmd or p.name().startswith(("ray::", "raylet", "gcs_server"))


def wait_gone(procs: list[psutil.Process], timeout: float = EXIT_WAIT_S) -> None:
    """Wait until every process in `procs` has exited; kill and fail on any still alive."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if _still_running(p)]
    if alive:
        described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive]
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        raise AssertionError(f"Ray processes left {timeout:.0f}s after shutdown: {described}")


def _still_running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def ray_session(**init_kwargs) -> Iterator[None]:
    """`ray.init(address="local", **init_kwargs)`; on exit `ray.shutdown()` and wait until every
    process that session started has ended (asserted). The suite's shared Ray (SharedRay), if it
    is up, is stopped first: this session is the test's own."""
    import ray

    SHARED.stop()
    ray.init(address="local", **init_kwargs)
    try:
        yield
    finally:
        procs = ray_descendants()
        ray.shutdown()
        wait_gone(procs)


class SharedRay:
    """The embedded Ray that conftest's `ray_local` gives its test modules: started by the first
    of them, kept for the next one (a Ray start and stop saved per module: seconds of 2 CPUs
    each), stopped as `ray_session` stops its own (the processes waited for, none left: asserted)
    before any test that does not take it, and at the session's end.

    What a module could leave behind for the next is checked before it is handed on: an actor
    still alive holds CPUs (`clean`); then the next module gets a fresh Ray."""

    KWARGS = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False}

    def __init__(self) -> None:
        self.up = False

    def start(self) -> None:
        """Ray as `ray_local` gives it, started unless this one is up and clean."""
        import ray

        if self.up and not (ray.is_initialized() and self.clean()):
            self.stop()
        if not self.up:
            ray.init(address="local", **self.KWARGS)
            self.up = True

    def clean(self, wait_s: float = 10.0) -> bool:
        """Whether nothing of a finished module is left: every CPU free again and no actor's
        process alive (one of no CPUs, as a weight store, holds memory and a metrics thread),
        waited for up to `wait_s`: an actor's end reaches the resource view, and its process
        exits, a moment after ray.kill."""
        import time

        import ray

        deadline = time.monotonic() + wait_s
        total = ray.cluster_resources().get("CPU")
        while ray.available_resources().get("CPU") != total or actor_processes():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        """Shut it down, if up, and wait until its processes have ended (asserted)."""
        import ray

        if not self.up:
            return
        self.up = False
        if not ray.is_initialized():  # a test shut it down itself
            return
        procs = ray_descendants()
        ray.shutdown()
        wait_gone(procs)


SHARED = SharedRay()


@contextlib.contextmanager
def ray_start(args: list[str], env: dict | None = None, prefix: list[str] | None = None):
    """`ray start --block <args>` in a session of its own (`prefix`: a command that execs it, as
    `unshare ... sh -c '...; exec "$@"' sh`), for a node this test process did not start through
    Ray's Python API (another environment, another mount namespace). Yields its Popen; on exit
    SIGTERM to `ray start` alone (it stops its node's processes: a signal to the whole session
    would leave it waiting a minute on a GCS already gone), then wait until every process of the
    session has ended (asserted)."""
    import signal
    import subprocess
    import sys

    node = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield node
    finally:
        procs = session_processes(node.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGTERM)
        node.wait(timeout=120)
        wait_gone(procs)
