"""The `appliance` process and the test process leave by os._exit, with their exit status and
their output intact, exactly when Ray's native threads are still running at exit (issue 17)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A module-level object whose __del__ prints at interpreter teardown: it prints after an ordinary
# exit and not after os._exit, so it tells which way the process left.
PROGRAM = textwrap.dedent(
    """
    import sys
    from appliance.cluster import exit as E

    E.install()

    class Teardown:
        def __del__(self):
            print("interpreter teardown ran", flush=True)

    marker = Teardown()
    if sys.argv[1] == "ray":
        import numpy as np
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        ref = ray.put(np.zeros(4_000_000))  # through the shared-memory store
        del ref
        ray.shutdown()
        print("ray threads after shutdown:", sorted(set(E.ray_threads_alive())))
    print("work done", flush=False)  # left in the buffer: the exit must flush it
    E.set_exit_code(3)
    sys.exit(3)
    """
)


def run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300
    )


def test_without_ray_the_process_exits_the_ordinary_way():
    done = run("plain")
    assert done.returncode == 3, done.stderr
    assert "work done" in done.stdout
    assert "interpreter teardown ran" in done.stdout


@pytest.mark.integration
def test_with_ray_threads_left_after_shutdown_it_leaves_by_os_exit_with_its_status():
    done = run("ray")
    assert done.returncode == 3, done.stderr[-3000:]
    # the condition the hook acts on is real: Ray left its threads running after shutdown
    assert "ray threads after shutdown: ['" in done.stdout, done.stdout
    assert "work done" in done.stdout  # flushed before os._exit
    assert "interpreter teardown ran" not in done.stdout
