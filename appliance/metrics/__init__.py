"""Prometheus metrics.

names.py      every metric's name, type, unit and help, once (`python -m appliance.metrics`
              prints them as the table in docs/metrics.md: __main__.py)
recorders.py  what the driver, trainers, workers and the store record (through Ray's
              metrics API where Ray runs)
endpoint.py   the port Ray exports them on, and its checks
"""

from appliance.metrics.names import MetricSpec
from appliance.metrics.recorders import (
    DriverMetrics,
    TokenizerMetrics,
    TrainerMetrics,
    WeightStoreMetrics,
)

__all__ = [
    "DriverMetrics",
    "MetricSpec",
    "TokenizerMetrics",
    "TrainerMetrics",
    "WeightStoreMetrics",
]
