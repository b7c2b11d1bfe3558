"""`appliance ...` run as a user runs it: a child process with its own session, stdout and
stderr piped, waited for with a bound (killed, with its session, when it runs past it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def cli(*args: str, env: dict) -> subprocess.Popen:
    """`python -m appliance <args>` with exactly `env` as its environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "appliance", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `p`; past `timeout` its session is killed (nothing left
    running after the test) and TimeoutExpired raised."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    return p.returncode, out, err
