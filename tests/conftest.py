"""Fixtures shared by the test modules that run the driver on embedded Ray."""

from __future__ import annotations

import importlib.util
import signal

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
