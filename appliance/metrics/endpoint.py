"""The node's metrics endpoint for an embedded Ray: which port it takes and how Ray is told.

`appliance train` picks the port (`choose_metrics_port`: --metrics-port when free, else 8080 or
the next free one, claimed with a lock file so two runs starting at once do not both take it),
starts Ray with `ray_init_kwargs(port)` and prints `metrics_url(port)`. `port_is_free` is the
check doctor and the tests use too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from appliance.errors import ConfigError
from appliance.storage.safe_open import open_regular

#: the task events the embedded Ray's GCS keeps (Ray's default: 100,000): what bounds its memory
TASK_EVENTS_KEPT = 1000

#: How often every Ray process pushes its metrics to the node's agent. Ray's default is 10 s;
#: 1 s (Ray's floor) lets a 1 s Prometheus scrape see each step within about a second.
METRICS_REPORT_INTERVAL_MS = 1000


def ray_init_kwargs(
    metrics_port: int, report_interval_ms: int = METRICS_REPORT_INTERVAL_MS
) -> dict[str, Any]:
    """Keyword arguments for the embedded `ray.init(address="local", ...)`.

    `_metrics_export_port` fixes the port of the node's Prometheus endpoint (Ray otherwise picks
    a random one; it binds 0.0.0.0). `_system_config` shortens Ray's metrics report interval;
    the environment variable `RAY_metrics_report_interval_ms` does the same for a cluster started
    with `ray start`. Both are only honoured by a `ray.init` that starts Ray, not one that
    connects to a running cluster (where KubeRay sets the port, 8080).

    Raises ConfigError when the port is taken: Ray would otherwise time out after ~30 s with
    "The current node timed out during startup".
    """
    if not is_tcp_port(metrics_port):
        raise ConfigError(port_range_error(metrics_port))
    if not port_is_free(metrics_port):
        raise ConfigError(
            f"--metrics-port {metrics_port} is already in use (another appliance run, or another "
            "service): stop it, or pick a free port with --metrics-port"
        )
    return {
        "_metrics_export_port": int(metrics_port),
        "_system_config": {
            "metrics_report_interval_ms": int(report_interval_ms),
            # the GCS keeps an event record of every task (for `ray list tasks`), up to 100,000
            # by default: ~11 KiB a step of a long run (docs/benchmarks.md, "Soak"). The
            # appliance reads none of them: the last TASK_EVENTS_KEPT are plenty to look at.
            "task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT,
        },
    }


#: --metrics-host: this machine only (the default), or every interface
LOOPBACK, EVERY_INTERFACE = "127.0.0.1", "0.0.0.0"


@contextlib.contextmanager
def metrics_bound_to(host: str) -> Iterator[None]:
    """Around the `ray.init` that starts the embedded Ray: its metrics endpoint listens on
    loopback unless `host` is EVERY_INTERFACE. Ray's metrics agent binds loopback only when the
    node's IP is loopback (reporter_agent: `get_localhost_ip() if is_localhost(ip) else ""`),
    and takes loopback as the node's IP only with its cluster mode off
    (`ray_constants.ENABLE_RAY_CLUSTER`, off by default on macOS and Windows): turned off while
    this single-node Ray starts, so nothing of it is reachable from another host."""
    if host == EVERY_INTERFACE:
        yield
        return
    from ray._private import ray_constants

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


def is_tcp_port(port: int) -> bool:
    """train's rule for --metrics-port (config.validate's too): 1-65535. 0 is refused: the kernel
    would pick some port that nothing scrapes."""
    return 0 < port < 65536


def port_range_error(port: int) -> str:
    """The one-line error for a --metrics-port outside 1-65535 (train's and doctor's)."""
    return f"--metrics-port must be a TCP port, 1 to 65535 (got {port}): give a free one"


def port_is_free(port: int) -> bool:
    """Whether a TCP port can be bound on all interfaces the way Ray's metrics agent binds it
    (a wsgiref server: SO_REUSEADDR set, so connections of a previous run still in TIME_WAIT do
    not make the port look taken). A port outside 1-65535 is never free (is_tcp_port)."""
    import socket

    if not is_tcp_port(port):
        return False

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_claimed: list = []  # open lock files of the ports this process claimed (held until it exits)


def _claim(port: int) -> bool:
    """Take this machine's lock for `port` (a file in the temp dir, locked for this process's
    life): two runs starting at once must not both see the port free and both take it."""
    import fcntl
    import os
    import tempfile
    from pathlib import Path

    path = Path(tempfile.gettempdir()) / f"appliance-metrics-port-{port}.lock"
    try:  # never through a link planted in the shared temp dir; another's file: not claimable
        fd = open_regular(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claimed.append(fd)  # held open on purpose: the lock lives as long as the descriptor
    return True


def default_candidates(default: int = 8080, tries: int = 100) -> range:
    """The ports train tries, in order, when --metrics-port is not given."""
    return range(default, min(default + tries, 65536))


def choose_metrics_port(given: int | None, default: int = 8080, tries: int = 100) -> int:
    """The port for the embedded Ray's metrics endpoint: `given` (--metrics-port) when it is free,
    else a one-line ConfigError; with none given, `default` or the next free port after it."""
    if given is not None:
        if not is_tcp_port(given):
            raise ConfigError(port_range_error(given))
        if not (port_is_free(given) and _claim(given)):
            raise ConfigError(
                f"--metrics-port {given} is already in use (another appliance run, or another "
                "service): stop it, pick another port, or leave --metrics-port out to take the "
                "next free one"
            )
        return given
    for port in default_candidates(default, tries):
        if port_is_free(port) and _claim(port):
            return port
    raise ConfigError(
        f"no free port for the metrics endpoint in {default}-{default + tries - 1}: "
        "pass a free one with --metrics-port"
    )


def metrics_url(port: int, host: str = "127.0.0.1") -> str:
    """The URL of the node's Prometheus endpoint, to print at start."""
    return f"http://{host}:{port}/metrics"
