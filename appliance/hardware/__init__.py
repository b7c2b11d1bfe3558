"""The machine: GPU classes and their peaks (gpus.py), measuring this box's copy bandwidth, matmul
rate and free memory (measure.py), and sampling the GPU's utilization through NVML while a run
trains (gpu_monitor.py; pynvml imported only there, when it starts)."""

from appliance.hardware.gpus import Gpu, peak_flops_per_second
from appliance.hardware.measure import host_memory_available

__all__ = ["Gpu", "host_memory_available", "peak_flops_per_second"]
