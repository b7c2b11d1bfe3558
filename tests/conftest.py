"""Fixtures shared by the test modules that run the driver on embedded Ray."""

from __future__ import annotations

import pytest

from tests.helpers_ray import ray_session


@pytest.fixture(scope="module")
def ray_local():
    """Embedded Ray for one test module (4 logical CPUs: two tokenizer workers and two trainers
    fit on this 2-core machine); shut down when the module's tests are done, and no process of it
    left behind (asserted)."""
    with ray_session(num_cpus=4, include_dashboard=False, log_to_driver=False):
        yield
