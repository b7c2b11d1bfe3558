"""The `appliance` executable (`appliance` and `python -m appliance`).

It imports nothing heavy itself: `appliance.cli.main` imports torch, a second or more, and a Ctrl-C
or SIGTERM in that second must end the command as it does later (`interrupted`, exit 130), not
with a KeyboardInterrupt traceback from inside torch's import.
"""

from __future__ import annotations

import sys


def entry() -> None:
    """`cli.main`, then an exit that is safe with Ray's threads still running
    (appliance/cluster/exit.py says why)."""
    from appliance import quiet
    from appliance.cluster import exit as safe_exit
    from appliance.interrupt import stop_at_once_on_sigterm

    quiet.install()  # a dead pipe on stdout/stderr (`| tee`, then Ctrl-C) never fails a run
    safe_exit.install()  # before Ray is imported, so that it runs after Ray's own exit hook
    stop_at_once_on_sigterm()  # `docker stop` ends a container's PID 1 before the step loop too
    try:
        try:
            from appliance.cli.main import main
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while torch imports
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        from appliance.errors import appliance_command

        main(prog_name=appliance_command())  # usage lines as the user can type the command
    except SystemExit as e:
        safe_exit.set_exit_code(safe_exit.exit_code_of(e))
        raise


if __name__ == "__main__":
    entry()
