"""`appliance ...` run as a user runs it: a child process with its own session, stdout and
stderr piped, waited for with a bound (killed, with its session, when it runs past it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers_net import free_port


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


def run_train(*argv: object, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m appliance train <argv>` run to its end (at most 300 s), on a free metrics port,
    with plain log lines; `env` is added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "appliance", "train", *map(str, argv),
         "--metrics-port", str(free_port()), "--log-format", "plain"],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def train_in_process(*argv: object) -> subprocess.CompletedProcess:
    """`appliance train <argv>` run to its end in this process, with plain log lines, its stdout
    and stderr apart: what `run_train` gives of a child, without a Python and a Ray session of
    its own. The test takes `ray_local`: the driver joins that Ray (whether a run starts one is
    not what such a test is about). The executable's own ending (exit status, the `error:` line
    on stderr) is what child runs show."""
    import gc

    from click.testing import CliRunner

    from appliance.cli.main import main

    result = CliRunner().invoke(main, ["train", *map(str, argv), "--log-format", "plain"])
    done = subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)
    del result  # its traceback holds a failed run's actors: let Ray end them now
    gc.collect()
    return done


def child_command() -> str:
    """How a `python -m appliance` child of this process (same PATH, same working directory)
    names the command in the hints it prints (errors.appliance_command)."""
    from pathlib import Path

    import appliance
    from appliance.errors import appliance_command

    saved = sys.argv
    sys.argv = [str(Path(appliance.__file__).parent / "__main__.py")]
    try:
        return appliance_command()
    finally:
        sys.argv = saved
