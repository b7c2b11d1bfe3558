"""The embedded Ray's GCS keeps a bounded number of task events (issue 44, item 14): the soak
benchmark (benchmarks/soak.py, docs/benchmarks.md "Soak") found its memory growing ~11 KiB a step,
the event records of every task, which Ray keeps up to 100,000 of by default."""

from __future__ import annotations

import subprocess
import sys

from appliance.metrics.endpoint import TASK_EVENTS_KEPT
from tests.helpers_net import free_port

STARTS_RAY = """
import sys
import ray
from ray._raylet import Config
from appliance.metrics.endpoint import ray_init_kwargs
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
         **ray_init_kwargs(int(sys.argv[1])))
print(Config.task_events_max_num_task_in_gcs())
ray.shutdown()
"""


def test_the_embedded_rays_gcs_keeps_a_bounded_number_of_task_events():
    done = subprocess.run(
        [sys.executable, "-c", STARTS_RAY, str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kept = int(done.stdout.split()[-1])
    assert kept == TASK_EVENTS_KEPT and kept < 100_000  # Ray's own default
