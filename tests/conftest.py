"""Fixtures shared by the test modules that run the driver on embedded Ray."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import signal
from pathlib import Path

import pytest

from appliance.cluster import exit as appliance_exit
from tests.helpers_ray import SHARED

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


# A completed `appliance train` waits one metrics report interval (1 s) before Ray shuts down,
# for Prometheus to see its last numbers (run/driver.py's _let_metrics_report). Nothing scrapes
# the tests' runs after their end but tests/e2e/test_prometheus_e2e.py's, which takes it back:
# every other run of the suite, in this process or a child, ends at once.
os.environ.setdefault("APPLIANCE_LAST_METRICS_WAIT_MS", "0")

# The GPU machine's image has torch, transformers and peft but not Ray, boto3, moto, python-hcl2
# or jsonschema (test dependencies `make test` installs): `pytest -m gpu tests/` must still
# collect there (bench/test_gpu_collect.py). A test module that imports one of these at its top
# has no gpu test; where the dependency is missing it is not collected.
OPTIONAL_DEPENDENCIES = ("ray", "boto3", "moto", "hcl2", "jsonschema")
_TESTS_DIR = Path(__file__).resolve().parent


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ValueError:  # in sys.modules without a spec
        return False


_MISSING = {name for name in OPTIONAL_DEPENDENCIES if _missing(name)}


def _top_level_imports(path: Path, seen: set | None = None) -> set[str]:
    """The top-level packages a module imports in its body (not in functions, not in strings),
    with those of the modules of this test suite it imports there."""
    seen = set() if seen is None else seen
    seen.add(path)
    modules = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.append(node.module)
    names = {m.split(".")[0] for m in modules}
    for module in modules:
        if module.startswith("tests."):
            source = _TESTS_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")
            if source.is_file() and source not in seen:
                names |= _top_level_imports(source, seen)
    return names


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if _MISSING and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if _top_level_imports(collection_path) & _MISSING:
            return True
    return None


def pytest_sessionfinish(session, exitstatus):
    appliance_exit.set_exit_code(int(exitstatus))


@pytest.fixture(scope="session")
def _shared_ray():
    """The suite's shared embedded Ray (tests/helpers_ray.py's SharedRay): stopped at the end,
    no process of it left behind (asserted)."""
    yield SHARED
    SHARED.stop()


@pytest.fixture(scope="module")
def ray_local(_shared_ray):
    """Embedded Ray for the test module (4 logical CPUs: two tokenizer workers and two trainers
    fit on this 2-core machine). One Ray serves the modules that take it, one after the other
    (pytest_collection_modifyitems runs them last, together): a module starts it only if none is
    up, or the last module left an actor holding CPUs. It is shut down, and no process of it
    left behind (asserted), before any other module's test and at the session's end."""
    _shared_ray.start()
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (tests/helpers_model.py's `llama-mha`, with the test tokenizer), made
    once for the session: for tests that read a model and never change it (copy it first)."""
    from tests.helpers_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "model", "llama-mha")


@pytest.fixture
def tiny_data(tmp_path) -> Path:
    """tmp_path/data.jsonl: 30 test sentences, one {"text": ...} record a line (the test's own
    copy: it may change it)."""
    from tests.helpers_data import sentences_jsonl

    return sentences_jsonl(tmp_path / "data.jsonl", 30)


# ------------------------------------------------------------------------------------ tiers
# `make test-fast` runs `-m "not integration and not slow and not gpu"`: the edit loop. The
# markers come from where a test lives and what it uses, so a new test lands in its tier without
# anyone remembering to mark it:
#
# - integration: every test under tests/e2e/ and tests/deploy/; and any test that uses, through
#   its fixtures or its own code, embedded Ray (`ray_local`, tests/helpers_ray.py's `ray_session`
#   and `ray_start`), the moto S3 server (`moto_server_url`, under every s3_* fixture, also when
#   fetched with request.getfixturevalue) or an `appliance` child process (tests/helpers_cli.py's
#   `cli`, `python -m appliance`, `appliance.cli.main` or `appliance.__main__` in a child) or
#   any other child of this interpreter (`sys.executable`). Code is followed into the suite's
#   own functions and classes it names. Marks written by hand stay valid.
# - slow: Inductor compiles, spawned process groups, the peer baselines' training runs, the GPU
#   image's collection of the whole suite, a QLoRA fine-tune compared with a bf16 one, and the
#   parity sweeps over every model family (SLOW, SLOW_FIXTURES, PARITY_SWEEPS below): seconds
#   to minutes of CPU each, for what an edit to one module rarely breaks.
# - gpu: marked by hand (`@pytest.mark.gpu`); skipped without CUDA.

INTEGRATION_DIRS = {"e2e", "deploy"}
INTEGRATION_FIXTURES = {"ray_local", "moto_server_url"}
# fixtures a test may fetch by name (request.getfixturevalue) that start a server
_SERVER_FIXTURE_NAMES = INTEGRATION_FIXTURES | {"s3_endpoint", "s3_client", "s3_bucket"}
# source that starts the CLI in a child process (`-c` programs, wrappers)
_CLI_SOURCE = ("from appliance.cli.main import main", "from appliance.__main__ import entry")

# path (relative to tests/) -> names (prefixes) of its slow tests; None: every test in it
SLOW: dict[str, tuple[str, ...] | None] = {
    "engine/test_compiled_blocks.py": None,  # Inductor compiles C++ for every variant
    "engine/test_kernel_tiers.py": ("test_compiled_blocks_keep_the_rule",),  # Inductor
    "engine/test_data_parallel_engine.py": None,  # mp.spawn of gloo process groups
    "engine/test_full_data_parallel.py": None,  # mp.spawn of gloo process groups
    "bench/test_block_step.py": ("test_the_compiled_block_equals_the_eager_block",),  # Inductor
    "bench/test_bench.py": ("test_compile_blocks_runs_the_engines_blocks_compiled",),  # Inductor
    "bench/test_gpu_collect.py": None,  # a child process collects the whole suite
    "quant/test_quant_parity.py": ("test_qlora_on_nf4_learns",),  # two fine-tunes, compared
    "bench/test_peer_bench.py": ("test_the_gpu_configuration_in_bf16_on_a_cpu",),  # both peers
}
# fixtures whose tests are slow: the peer baselines' runs (FSDP2 on a gloo group, HF + PEFT)
SLOW_FIXTURES = {"hf_run", "fsdp_run", "peer_run"}
# parity sweeps: in these modules, a test's instances for the model families beyond the Llama,
# Mistral and Qwen 2 variants (tests/helpers_model.py's FAMILY_VARIANTS) are slow; the first
# variants stay in the fast tier, so an edit still meets one parity check of each kind
PARITY_SWEEPS = {
    "engine/test_engine_parity.py",
    "adapter/test_evaluate.py",
    "adapter/test_export.py",
    "engine/test_kernel_tiers.py",
}


def _integration_helpers() -> set:
    from tests import helpers_cli, helpers_ray

    return {helpers_cli.cli, helpers_ray.ray_session, helpers_ray.ray_start}


def _flat(consts) -> list:
    out = []
    for k in consts:
        out += _flat(k) if isinstance(k, tuple | frozenset) else [k]
    return out


def _starts_something(consts: list, names: tuple = ()) -> bool:
    """Whether one code object (its constants, the names it uses) names a server fixture, starts
    the CLI in a child or starts a child of this interpreter (`sys.executable`)."""
    if "sys" in names and "executable" in names:
        return True
    strings = [k for k in consts if isinstance(k, str)]
    if any(k in _SERVER_FIXTURE_NAMES for k in strings):
        return True
    if "-m" in strings and "appliance" in strings:  # [sys.executable, "-m", "appliance", ...]
        return True
    return any(source in k for k in strings for source in _CLI_SOURCE)


def _code_uses(fn, targets: set, seen: set) -> bool:
    """Whether `fn`'s code (nested functions included) refers to one of `targets` or starts
    something (_starts_something), itself or through a function, class or string of this test
    suite it names (followed transitively)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return False
    seen.add(fn)
    glob = getattr(fn, "__globals__", {})
    stack = [code]
    while stack:
        c = stack.pop()
        consts = _flat(c.co_consts)
        stack += [k for k in consts if inspect.iscode(k)]
        if _starts_something(consts, c.co_names):
            return True
        for name in c.co_names:
            obj = glob.get(name)
            if obj is None:
                continue
            if isinstance(obj, str):
                if _starts_something([obj]):
                    return True
                continue
            try:
                if obj in targets:
                    return True
            except TypeError:  # unhashable
                continue
            if inspect.isclass(obj):
                fns = [v for v in vars(obj).values() if inspect.isfunction(v)]
            else:
                fns = [obj] if inspect.isfunction(obj) else []
            for f in fns:
                if f.__module__.startswith("tests") and _code_uses(f, targets, seen):
                    return True
    return False


def _is_integration(item: pytest.Item, rel: Path, targets: set) -> bool:
    if rel.parts[0] in INTEGRATION_DIRS:
        return True
    if set(getattr(item, "fixturenames", ())) & INTEGRATION_FIXTURES:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    seen: set = set()
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name, fixturedefs in defs.items():
        if params.get(name) == "local":  # the local half of a ["local", "s3"] fixture
            continue
        for fixturedef in fixturedefs:
            if _code_uses(fixturedef.func, targets, seen):
                return True
    func = getattr(item, "function", None)
    return func is not None and _code_uses(func, targets, seen)


def _family_sweep(item: pytest.Item) -> bool:
    from tests.helpers_model import FAMILY_VARIANTS

    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(v in FAMILY_VARIANTS for v in _flat(params.values()) if isinstance(v, str))


def _is_slow(item: pytest.Item, rel: Path) -> bool:
    if set(getattr(item, "fixturenames", ())) & SLOW_FIXTURES:
        return True
    if rel.as_posix() in PARITY_SWEEPS and _family_sweep(item):
        return True
    names = SLOW.get(rel.as_posix(), ())
    return names is None or getattr(item, "originalname", item.name).startswith(names)


def _takes_shared_ray(item: pytest.Item) -> bool:
    """Whether `item` takes this conftest's `ray_local` (not a module's own of that name)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("ray_local")
    return (
        bool(defs)
        and Path(inspect.getsourcefile(defs[-1].func)).resolve() == Path(__file__).resolve()
    )


# the modules with a test that takes the shared Ray (pytest_collection_modifyitems)
_SHARED_RAY_MODULES: set[Path] = set()


def _group_shared_ray_modules(items: list) -> None:
    """Run the modules that take the shared Ray last, one after the other, each module's tests in
    their order: the Ray one starts serves them all (helpers_ray.SharedRay)."""
    _SHARED_RAY_MODULES.update(Path(item.path) for item in items if _takes_shared_ray(item))
    items.sort(key=lambda item: Path(item.path) in _SHARED_RAY_MODULES)  # stable


def pytest_runtest_setup(item):
    """Only the modules that take the shared Ray run beside it: it is stopped before any other."""
    if SHARED.up and Path(item.path) not in _SHARED_RAY_MODULES:
        SHARED.stop()


def pytest_collection_modifyitems(config, items):
    _group_shared_ray_modules(items)
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
