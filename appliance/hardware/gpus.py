"""The GPUs `appliance plan` knows: memory, host→device bandwidth B, matmul rate P, and the cloud
instance (with its on-demand price) the Terraform module rents for each class.

One table, one place. Every figure carries its source (docs/plan.md repeats the table with dates):

- `memory_bytes`: the total the driver reports (`nvidia-smi --query-gpu=memory.total`, MiB), which
  is what `torch.cuda.get_device_properties().total_memory` sees; the engine budgets 90 % of it
  unless `--gpu-memory-budget` says otherwise.
- `h2d_bytes_per_second` (B): pinned host→device copy rate the plan assumes. PCIe Gen4 x16 is
  32 GB/s on paper and measures about 25 GB/s pinned; Gen5 x16 is 64 GB/s on paper, about 50
  measured. Replace it with `appliance doctor`'s measured figure on the real box.
- `paper_flops_per_second`: dense (no sparsity) bf16 tensor-core rate from the vendor datasheet,
  with fp32 accumulation.
- `flops_per_second` (P): what the plan assumes. A measured figure where we have one (A10G: about
  70 TFLOP/s bf16 in a large matmul); otherwise `DERATE` × paper, since no card sustains its
  paper rate in real matmuls.

Prices: on-demand Linux, US East (N. Virginia), per instance-hour, from the AWS EC2 on-demand
pricing page (see PRICES_AS_OF). Prices change: `--price-per-hour` overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
DERATE = 0.7  # assumed sustained / paper bf16 matmul rate where no measured figure is given
PRICES_AS_OF = "2025 list prices (AWS EC2 on-demand page, us-east-1, Linux); not re-checked"
PRICE_SOURCE = "https://aws.amazon.com/ec2/pricing/on-demand/"


@dataclass(frozen=True)
class Instance:
    """A cloud instance type: its GPUs and host RAM, and its on-demand $ per instance-hour."""

    name: str
    gpus: int
    host_ram_bytes: int
    usd_per_hour: float | None  # None: no on-demand price we can vouch for; use --price-per-hour

    @property
    def usd_per_gpu_hour(self) -> float | None:
        return None if self.usd_per_hour is None else self.usd_per_hour / self.gpus


@dataclass(frozen=True)
class Gpu:
    """One GPU class (see the module docstring for what each figure means and where it is from)."""

    name: str  # the vendor's name
    memory_bytes: int
    h2d_bytes_per_second: float  # B, assumed pinned host→device rate
    paper_flops_per_second: float  # datasheet dense bf16
    flops_per_second: float  # P, assumed
    bf16: bool
    instance: Instance  # what the Terraform module (or the nearest AWS type) rents for it
    source: str  # where the figures come from


GiB = 2**30
PCIE4, PCIE5 = 25e9, 50e9  # assumed pinned H2D: Gen4 x16 (32 GB/s paper), Gen5 x16 (64 paper)

# The instances terraform/main.tf rents per class (g5.8xlarge for a10, g6e.8xlarge for 4090),
# and the AWS types that carry the other GPUs.
G5_8XL = Instance("g5.8xlarge", 1, 128 * GiB, 2.448)
G6_8XL = Instance("g6.8xlarge", 1, 128 * GiB, 2.0144)
G6E_8XL = Instance("g6e.8xlarge", 1, 256 * GiB, 4.52856)
P4D_24XL = Instance("p4d.24xlarge", 8, 1152 * GiB, 32.7726)
P5_48XL = Instance("p5.48xlarge", 8, 2048 * GiB, 98.32)
P5E_48XL = Instance("p5e.48xlarge", 8, 2048 * GiB, None)  # capacity blocks; no on-demand list

GPUS: dict[str, Gpu] = {
    "a10": Gpu(
        "NVIDIA A10 24GB", 23028 * MiB, PCIE4, 125e12, 70e12, True, G5_8XL,
        "NVIDIA A10 datasheet (125 TFLOP/s bf16 dense, PCIe Gen4 x16); P = 70 measured on an A10G",
    ),
    "a10g": Gpu(
        "NVIDIA A10G 24GB", 23028 * MiB, PCIE4, 125e12, 70e12, True, G5_8XL,
        "AWS g5 (A10G, an A10 variant; NVIDIA publishes no datasheet): P = 70 measured",
    ),
    "4090": Gpu(
        "NVIDIA GeForce RTX 4090 24GB", 24564 * MiB, PCIE4, 165.2e12, DERATE * 165.2e12, True,
        G6E_8XL,
        "NVIDIA Ada whitepaper (165.2 TFLOP/s bf16 dense, fp32 accumulate; PCIe Gen4 x16); "
        "the Terraform 4090 class rents a g6e (L40S, same AD102 die)",
    ),
    "l4": Gpu(
        "NVIDIA L4 24GB", 23034 * MiB, PCIE4, 121e12, DERATE * 121e12, True, G6_8XL,
        "NVIDIA L4 datasheet (121 TFLOP/s bf16 dense, PCIe Gen4 x16)",
    ),
    "l40s": Gpu(
        "NVIDIA L40S 48GB", 46068 * MiB, PCIE4, 362.05e12, DERATE * 362.05e12, True, G6E_8XL,
        "NVIDIA L40S datasheet (362 TFLOP/s bf16 dense, PCIe Gen4 x16)",
    ),
    "a100": Gpu(
        "NVIDIA A100-SXM4 40GB", 40960 * MiB, PCIE4, 312e12, DERATE * 312e12, True, P4D_24XL,
        "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense; host link PCIe Gen4 x16)",
    ),
    "h100": Gpu(
        "NVIDIA H100 SXM5 80GB", 81559 * MiB, PCIE5, 989.4e12, DERATE * 989.4e12, True, P5_48XL,
        "NVIDIA H100 datasheet (989 TFLOP/s bf16 dense SXM; host link PCIe Gen5 x16)",
    ),
    "h200": Gpu(
        "NVIDIA H200 SXM 141GB", 143771 * MiB, PCIE5, 989.4e12, DERATE * 989.4e12, True, P5E_48XL,
        "NVIDIA H200 datasheet (989 TFLOP/s bf16 dense; host link PCIe Gen5 x16)",
    ),
}  # fmt: skip


#: Device memory bandwidth (bytes/s) by class, from the same datasheets: what the elementwise work
#: (norms, RoPE, activations, residual adds, the loss) is bounded by. `appliance plan` divides the
#: step's least elementwise bytes (engine/flops.py) by it, on a line of its own beside the floor.
MEMORY_BYTES_PER_SECOND: dict[str, float] = {
    "a10": 600e9, "a10g": 600e9, "4090": 1008e9, "l4": 300e9, "l40s": 864e9,
    "a100": 1555e9, "h100": 3350e9, "h200": 4800e9,
}  # fmt: skip


#: Dense bf16 tensor-core peak FLOP/s (no sparsity) by device-name substring, from the vendors'
#: data sheets; the first match wins, so longer names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def peak_flops_per_second(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU by its name (`torch.cuda.get_device_name()`), or None."""
    if not device_name:
        return None
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None
