"""Leave a process that used Ray without running C++ static destructors under Ray's live threads.

Ray 2.60 (`ray/_raylet.so`) keeps native threads running after `ray.shutdown()` in a driver:
the GCS client's IO thread (`gcs_client_io_s`, in `io_context::run`), gRPC's event-engine and
timer threads, and, once the driver has moved a large object through the shared-memory store
(`ray.put`, or `ray.get` of a large result), a boost::asio thread pool named after the thread
that started it (`worker.io`). `gdb -p` on a driver after `ray.shutdown()` shows all of them
(docs/architecture.md, "Exit"). At interpreter exit `exit()` then destroys `_raylet.so`'s static
objects while those threads still run, and now and then the process dies with SIGSEGV after it
has finished its work: `make test` printed "364 passed" and then make reported a segmentation
fault (issue 17). Ray's own worker processes never take that path: they leave with
`QuickExit()`, and its source says why ("`exit()` will destruct static objects in an incorrect
order, which will lead to core dumps").

So the `appliance` command and the test process do the same, last: after every atexit handler
has run (Ray's own `ray.shutdown`, logging, temp-dir finalizers), and only while one of Ray's
threads is alive, they flush stdout/stderr and `os._exit` with the exit code they were going to
return. Nothing the process wrote is lost; only interpreter teardown is skipped.
"""

from __future__ import annotations

import atexit
import os
import sys

# Thread names (Linux `comm`, 15 characters at most) of Ray's and its gRPC's native threads.
RAY_THREAD_PREFIXES = (
    "gcs_client_io",
    "worker.",
    "global.accessor",
    "client.poll",
    "server.poll",
    "event_engine",
    "grpc_global_tim",
    "task_event_buff",
)

_exit_code: int | None = None
_installed = False


def ray_threads_alive() -> list[str]:
    """Names of this process's threads that belong to Ray's native code (Linux; [] elsewhere)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if name.startswith(RAY_THREAD_PREFIXES):
            names.append(name)
    return names


def install() -> None:
    """Register the exit hook. Call it before Ray is imported: atexit runs handlers in reverse
    order of registration, so this one then runs after Ray's own `ray.shutdown` hook."""
    global _installed
    if not _installed:
        atexit.register(_leave)
        _installed = True


def set_exit_code(code: int) -> None:
    """The status the process is about to exit with; the hook only acts once this is known."""
    global _exit_code
    _exit_code = code


def exit_code_of(e: SystemExit) -> int:
    """The status `sys.exit(e.code)` gives: None is 0, an int itself, anything else 1."""
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1


def _leave() -> None:
    if _exit_code is None or not ray_threads_alive():
        return  # nothing of Ray's left running: an ordinary interpreter exit is safe
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or broken pipe: nothing more can be written there anyway
    os._exit(_exit_code)
