"""Peer baseline: PyTorch FSDP2 (`fully_shard`) with `CPUOffloadPolicy` on one GPU.

On the GPU run of issue 10 (from the repository root, beside `appliance bench` and
benchmarks/peer_hf_peft.py; docs/benchmarks.md, "Peers: how they are run"):

    PYTHONPATH=$PWD python -m benchmarks.peer_fsdp2_offload --preset 13b --device cuda --json fsdp2-13b.json
    PYTHONPATH=$PWD python -m benchmarks.peer_fsdp2_offload --preset tiny --device cpu   # seconds

What runs: `LlamaForCausalLM` of the preset's shape with PEFT LoRA (r16, alpha 32, dropout 0 on
q, k, v, o, gate, up, down) and transformers' gradient checkpointing, built on the meta device;
`fully_shard` on each decoder layer, then on the root, with
`offload_policy=CPUOffloadPolicy()` and `MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`; then `to_empty(device="cpu")` and `appliance bench`'s own synthetic
weights and LoRA start (benchmarks/peers_common.py). The sharded parameters (bf16 base weights,
fp32 adapters) live in pinned host memory; FSDP2 copies each layer's weights to the GPU before its
forward and again before its backward (recompute included), frees them after (the defaults:
`reshard_after_forward=True`), and the AdamW step runs on the CPU, where the sharded parameters
and their gradients are. Gradient accumulation over the micro-batches is FSDP2's own:
`set_requires_gradient_sync(False)` for all but the last micro-batch of a step.

One process, world size 1: the script sets MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port)
itself and starts the group with nccl on CUDA, gloo on a CPU. Tokens, loss and optimizer are the
bench's (peers_common.py). With one rank, torch 2.11's FSDP2 has no all-gather to run: it copies
each layer's sharded (host) parameters to the GPU when the layer is about to run, on the compute
stream (`FSDPParamGroup.wait_for_unshard`), so its copies do not overlap compute. That is FSDP2
with CPU offload on one GPU as PyTorch ships it, which is what this peer measures; the results
say "one GPU" for that reason.

On a CPU (CPU-only torch, gloo) FSDP2 with CPUOffloadPolicy runs, but only with
`pin_memory=False` (pinning needs an accelerator), and the "offload" is nominal: host and device
are the same memory, so nothing is copied. The JSON says so (`offload: true`, `pin_memory:
false`, `offload_nominal: true`); the CPU run exists to test the script, not to time offloading.
The base weights must fit in host memory (90% of what is available): 70B's 129 GiB of bf16 does
not on a 128 GiB host, and is reported as `fits: false` with the reason, as a CUDA
out-of-memory error is.
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from benchmarks import peers_common as pc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process_group(setup: pc.Setup):
    """A one-process group (world size 1) for the run: nccl on CUDA, gloo on a CPU."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    dist.init_process_group("nccl" if setup.device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(setup: pc.Setup):
    """The PeftModel, each decoder layer and the root fully_shard-ed with CPU offload, filled
    with the bench's weights; its AdamW (over the sharded LoRA parameters, on the CPU)."""
    cuda = setup.device.type == "cuda"
    pc.check_host_memory(setup, pinned=cuda)  # every weight lives in (pinned) host memory
    model = pc.build_meta_model(setup.args, setup.dtype)
    mesh = init_device_mesh(setup.device.type, (1,))
    offload = CPUOffloadPolicy(pin_memory=cuda)  # pinning needs an accelerator
    mp = (
        MixedPrecisionPolicy(param_dtype=setup.dtype, reduce_dtype=torch.float32)
        if setup.dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    model.to_empty(device="cpu")  # sharded parameters live on the host
    pc.fill_weights(model, setup.args, setup.device)
    facts = {
        "offload": True,
        "offload_policy": f"CPUOffloadPolicy(pin_memory={cuda})",
        "pin_memory": cuda,
        "offload_nominal": not cuda,  # on a CPU the host is the device: nothing is copied
        "mixed_precision": {
            "param_dtype": str(mp.param_dtype).removeprefix("torch.") if mp.param_dtype else None,
            "reduce_dtype": str(mp.reduce_dtype).removeprefix("torch.")
            if mp.reduce_dtype
            else None,
        },
        "fsdp": {
            "api": "torch.distributed.fsdp.fully_shard (FSDP2)",
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "units": "each decoder layer, then the root (embeddings, final norm, LM head)",
            "reshard_after_forward": True,
            "gradient_accumulation": "set_requires_gradient_sync(False) but on the last",
        },
    }
    return model, pc.make_optimizer(model), facts


def micro_batch(model: torch.nn.Module, k: int, last: bool) -> None:
    model.set_requires_gradient_sync(last)


PEER = pc.Peer(
    system="fsdp2-offload",
    label="PyTorch FSDP2 + CPUOffloadPolicy, gradient checkpointing",
    build=build,
    micro_batch=micro_batch,
    setup_context=process_group,
)

DESCRIPTION = (
    "Time LoRA training of a preset's Llama shape with PyTorch FSDP2 (fully_shard, "
    "CPUOffloadPolicy) on one device: the same model, LoRA and tokens as appliance bench."
)


def main(argv: list[str] | None = None) -> int:
    return pc.main(PEER, argv, "python -m benchmarks.peer_fsdp2_offload", DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
