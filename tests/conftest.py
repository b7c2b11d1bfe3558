"""Fixtures shared by the test modules that run the driver on embedded Ray."""

from __future__ import annotations

import importlib.util
import inspect
import signal
from pathlib import Path

import pytest

from appliance.cluster import exit as appliance_exit
from tests.helpers_ray import ray_session

# Ray's native threads outlive ray.shutdown() and can crash the interpreter's exit after a green
# run (issue 17; appliance/cluster/exit.py has the evidence): end this process the way `appliance` ends,
# with pytest's own exit status, once every atexit handler has run. Installed here, before any
# test module imports Ray, so that it runs after Ray's own exit hook.
appliance_exit.install()

# A script's background job (`make test &`, `nohup ... &`) starts with SIGINT ignored, and every
# process it starts inherits that: the tests that press Ctrl-C on an `appliance` child would see
# it ignored (its run went on to its end). Caught here, SIGINT is back at its default in children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The GPU machine's image has torch, transformers and peft but not Ray (its wheel is too big to
# carry there): `pytest -m gpu tests/` must still collect. These modules import Ray at the top and
# have no gpu test; where Ray is missing they are not collected (CI and `make test` have Ray).
if importlib.util.find_spec("ray") is None:
    collect_ignore = [
        "actors/test_weight_store.py", "e2e/test_cluster.py", "e2e/test_train_e2e.py",
        "quant/test_quant_store.py", "run/test_data_parallel.py",
    ]  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    appliance_exit.set_exit_code(int(exitstatus))


@pytest.fixture(scope="module")
def ray_local():
    """Embedded Ray for one test module (4 logical CPUs: two tokenizer workers and two trainers
    fit on this 2-core machine); shut down when the module's tests are done, and no process of it
    left behind (asserted)."""
    with ray_session(num_cpus=4, include_dashboard=False, log_to_driver=False):
        yield


# ------------------------------------------------------------------------------------ tiers
# `make test-fast` runs `-m "not integration and not slow and not gpu"`: the edit loop. The
# markers come from where a test lives and what it uses, so a new test lands in its tier without
# anyone remembering to mark it:
#
# - integration: every test under tests/e2e/ and tests/deploy/; any test that uses, through its
#   fixtures or its own code, embedded Ray (`ray_local`, `ray_session`, `ray_start`), the moto S3
#   server (`moto_server_url`, under every s3_* fixture) or an `appliance` child process
#   (tests/helpers_cli.py's `cli`). Explicit `@pytest.mark.integration` marks stay valid.
# - slow: what compiles with Inductor, spawns process groups or sweeps every model family
#   through a parity check (SLOW below); each costs seconds to minutes of CPU and proves
#   something an edit to one module rarely breaks.
# - gpu: marked by hand (`@pytest.mark.gpu`); skipped without CUDA.

INTEGRATION_DIRS = {"e2e", "deploy"}
INTEGRATION_FIXTURES = {"ray_local", "moto_server_url"}

# path (relative to tests/) -> test names (prefixes) that are slow; None: the whole module.
SLOW: dict[str, tuple[str, ...] | None] = {
    "engine/test_compiled_blocks.py": None,  # Inductor compiles C++ for every variant
    "engine/test_data_parallel_engine.py": None,  # mp.spawn of gloo process groups
    "bench/test_block_step.py": ("test_the_compiled_block_equals_the_eager_block",),  # Inductor
}

_TESTS_DIR = Path(__file__).resolve().parent


def _integration_helpers() -> set:
    from tests import helpers_cli, helpers_ray

    return {helpers_cli.cli, helpers_ray.ray_session, helpers_ray.ray_start}


def _code_uses(fn, targets: set, integration_names: set, seen: set) -> bool:
    """Whether `fn`'s code refers to one of `targets`, or names a fixture in `integration_names`
    (request.getfixturevalue("s3_bucket")), directly or through a function of this test suite it
    calls (followed by name, transitively)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return False
    seen.add(fn)
    glob = getattr(fn, "__globals__", {})
    stack = [code]
    while stack:
        c = stack.pop()
        stack += [k for k in c.co_consts if inspect.iscode(k)]
        if any(isinstance(k, str) and k in integration_names for k in c.co_consts):
            return True
        for name in c.co_names:
            obj = glob.get(name)
            if obj is None:
                continue
            try:
                if obj in targets:
                    return True
            except TypeError:  # unhashable
                continue
            if inspect.isclass(obj):
                obj_fns = [v for v in vars(obj).values() if inspect.isfunction(v)]
            else:
                obj_fns = [obj] if inspect.isfunction(obj) else []
            for f in obj_fns:
                if f.__module__.startswith("tests") and _code_uses(
                    f, targets, integration_names, seen
                ):
                    return True
    return False


def _is_integration(item: pytest.Item, rel: Path, targets: set) -> bool:
    if rel.parts[0] in INTEGRATION_DIRS:
        return True
    names = set(getattr(item, "fixturenames", ()))
    if names & INTEGRATION_FIXTURES:
        return True
    integration_names = INTEGRATION_FIXTURES | {"s3_endpoint", "s3_client", "s3_bucket"}
    params = getattr(getattr(item, "callspec", None), "params", {})
    seen: set = set()
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name, fixturedefs in defs.items():
        for fixturedef in fixturedefs:
            if params.get(name) == "local":  # the local half of a ["local", "s3"] fixture
                continue
            if _code_uses(fixturedef.func, targets, integration_names, seen):
                return True
    func = getattr(item, "function", None)
    return func is not None and _code_uses(func, targets, integration_names, seen)


def _is_slow(item: pytest.Item, rel: Path) -> bool:
    key = rel.as_posix()
    if key not in SLOW:
        return False
    names = SLOW[key]
    return names is None or item.originalname.startswith(names)


def pytest_collection_modifyitems(config, items):
    targets = _integration_helpers()
    for item in items:
        try:
            rel = Path(item.path).resolve().relative_to(_TESTS_DIR)
        except ValueError:
            continue
        if _is_integration(item, rel, targets):
            item.add_marker(pytest.mark.integration)
        if _is_slow(item, rel):
            item.add_marker(pytest.mark.slow)
