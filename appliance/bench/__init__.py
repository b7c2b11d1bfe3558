"""The benchmarks: `python -m appliance.bench` (and `appliance bench`).

step.py       one training step, streamed or resident, timed against its floor (run_bench)
cli.py        the bench's command line
table.py      the printed table and the JSON file every benchmark writes
load.py       loading a checkpoint into the weight store, and the quantizers' rates
synthetic.py  random weights for a preset's shapes, without a checkpoint on disk
"""

from appliance.bench.step import run_bench
from appliance.bench.synthetic import SyntheticBlockSource

__all__ = ["SyntheticBlockSource", "run_bench"]
