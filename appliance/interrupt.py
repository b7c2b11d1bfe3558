"""Ctrl-C and SIGTERM: stop at the next step boundary with a checkpoint, not mid-step.

The first SIGINT (Ctrl-C) or SIGTERM (what `docker stop` and Kubernetes send) only asks: the step
loop sees `requested` after the step in flight, writes a checkpoint and raises `RunInterrupted`;
the CLI prints where the run is and how to resume it, and exits 130 for either signal (the
status a Ctrl-C gives; a stop asked for and honoured, whoever asked). A second signal stops at
once (KeyboardInterrupt), losing the steps since the last checkpoint. Before the step loop
(downloads, the weight store's load) either signal stops at once: `stop_at_once_on_sigterm`.

    with GracefulStop() as stop:
        run.interrupt = stop
        run.train()  # raises RunInterrupted at a step boundary after a signal
"""

from __future__ import annotations

import signal
import sys
import threading

from appliance.quiet import write_fd


def _stop_now(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_at_once_on_sigterm() -> None:
    """Outside the step loop (downloading the model, loading the weight store, starting
    actors) SIGTERM stops at once, as Ctrl-C does: KeyboardInterrupt, which the CLI reports as
    `interrupted` and exit 130. Without a handler a container's PID 1 (the image runs
    `appliance` as PID 1) ignores SIGTERM, so `docker stop` would wait out its timeout and then
    SIGKILL. The `appliance` executable installs it first thing; main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_now)


def sigterm_stops_at_once() -> bool:
    """Whether `stop_at_once_on_sigterm` is in force (ray.init would replace it with its own
    handler, a silent sys.exit(15): start.start_ray keeps it, holding signals meanwhile)."""
    return signal.getsignal(signal.SIGTERM) is _stop_now


def stopped_at_once(e: BaseException) -> bool:
    """Whether `e` is a stop at once (the second Ctrl-C): KeyboardInterrupt, or the SystemError
    that a Cython function interrupted by it (Ray's `CoreWorker.wait`) makes of it ("returned a
    result with an exception set", the KeyboardInterrupt its cause)."""
    for _ in range(10):
        if isinstance(e, KeyboardInterrupt):
            return True
        if not isinstance(e, SystemError) or (e.__cause__ or e.__context__) is None:
            return False
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


class RunInterrupted(Exception):
    """The run stopped at a step boundary after SIGINT/SIGTERM, its checkpoint written. Not a
    user error: the CLI prints the message as it is and exits `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class GracefulStop:
    """Catches SIGINT and SIGTERM while the run is inside the `with` (main thread only; elsewhere
    it does nothing and the default handlers stay)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.requested = signal.Signals(signum)
        # os.write, not print: a handler that prints while the main thread is printing to the same
        # buffered stream raises "reentrant call"; write_fd: a dead pipe (`| tee`, whose Ctrl-C
        # ended tee too) must not raise into the ray.wait this interrupted
        write_fd(
            sys.stderr.fileno(),
            f"\n{self.requested.name}: stopping after the step in flight to write a checkpoint "
            "(press Ctrl-C again to stop at once, losing the steps since the last one)\n".encode(),
        )

    @property
    def exit_code(self) -> int:
        return 128 + int(self.requested or signal.SIGINT)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()
