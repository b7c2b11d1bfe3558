"""The suite's shared Ray (tests/helpers_ray.py's SharedRay, behind conftest's `ray_local`) is
handed from one module to the next only when nothing of the last one holds its CPUs."""

from __future__ import annotations

from tests.helpers_ray import SHARED


def test_an_actor_left_holding_a_cpu_makes_the_shared_ray_unclean(ray_local):
    import ray

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    assert ray.get(holder.ping.remote()) == 1
    assert SHARED.up and not SHARED.clean(wait_s=1.0)  # the next module would get a fresh Ray
    ray.kill(holder)
    assert SHARED.clean()
