"""Scenarios run side by side: a test module's `appliance` child processes, three at a time.

A child run spends much of its time waiting (Ray starting, actors importing torch, a process
ending) and leaves a core of a 2-core machine idle meanwhile. A module whose runs are independent
of each other writes each test's runs as a scenario (a function that starts, drives and checks
its processes, asserts included) and a module fixture starts them all with `side_by_side`; each
test then waits for its own with `ran`, which raises what its scenario raised. A signal still
goes in when the run's own line is read: each scenario reads its runs in its own thread.

Only what is safe in a thread goes in a scenario: its own temp directory (tmp_path_factory), no
function-scoped fixture (monkeypatch, capsys), no signal handler of this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

#: scenarios running at once: on 2 cores three beat two, as each run waits much of its time
#: (tests/e2e/test_faults.py: 97 s with two, 92 s with three, 91 s with four; 2026-11-28)
SIDE_BY_SIDE = 3
#: how long a test waits for its scenario: its turn in the queue and its own run
WAIT_S = 900


@contextlib.contextmanager
def side_by_side(
    scenarios: dict[str, Callable[[], Any]], workers: int = SIDE_BY_SIDE
) -> Iterator[dict[str, Future]]:
    """Start every scenario, `workers` at a time, in the order given (the longest first: the
    last to start should not be the one that runs longest); yields name -> its future, and on
    exit waits for every one to end."""
    with ThreadPoolExecutor(workers) as pool:
        yield {name: pool.submit(scenario) for name, scenario in scenarios.items()}


def ran(futures: dict[str, Future], name: str) -> Any:
    """What scenario `name` returned; raises what it raised (its assertion, its traceback)."""
    return futures[name].result(timeout=WAIT_S)


def selected(request) -> set[str]:
    """The names (without parameters) of the tests of the requesting module that this session
    runs: a module starts only their scenarios (`pytest -k` runs one, not all)."""
    return {item.originalname for item in request.session.items if item.module is request.module}


@contextlib.contextmanager
def selected_side_by_side(
    request, tmp_path_factory, scenarios: dict[str, Callable[..., Any]], *args: Any
) -> Iterator[dict[str, Future]]:
    """`side_by_side` over the scenarios (test name -> function) of the requesting module's
    tests that this session runs, each called with `args` and a temp directory of its own; the
    futures are keyed by test name."""
    tests = selected(request)
    chosen = {
        test: partial(scenario, *args, tmp_path_factory.mktemp("scenario"))
        for test, scenario in scenarios.items()
        if test in tests
    }
    with side_by_side(chosen) as futures:
        yield futures
