"""The machine: GPU classes and their peaks (gpus.py), measuring this box's copy bandwidth, matmul
rate and free memory (measure.py), the host's shared memory and RAM for a run (host.py: /dev/shm,
its huge-page policy), and sampling the GPU's utilization through NVML while a run trains
(gpu_monitor.py; pynvml imported only there, when it starts)."""

from appliance.hardware.gpus import Gpu, peak_flops_per_second
from appliance.hardware.host import ram_available_bytes, shm_available_bytes
from appliance.hardware.measure import host_memory_available

__all__ = [
    "Gpu",
    "host_memory_available",
    "peak_flops_per_second",
    "ram_available_bytes",
    "shm_available_bytes",
]
