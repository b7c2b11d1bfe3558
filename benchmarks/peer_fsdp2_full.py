"""Peer baseline for a full fine-tune: PyTorch FSDP2 (`fully_shard`) with `CPUOffloadPolicy` on
one device, every weight trained (issue 46's peer; benchmarks/peer_fsdp2_offload.py trains LoRA).

    PYTHONPATH=$PWD python -m benchmarks.peer_fsdp2_full --preset 7b --device cuda --json fsdp2-full-7b.json
    PYTHONPATH=$PWD python -m benchmarks.peer_fsdp2_full --preset tiny --device cpu   # seconds, gloo

What runs: `LlamaForCausalLM` of the preset's shape with transformers' gradient checkpointing,
built on the meta device in fp32; `fully_shard` on each decoder layer, then the root, with
`offload_policy=CPUOffloadPolicy()` and `MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)` on CUDA: the sharded fp32 parameters (the master weights) live in
(pinned) host memory, each layer is cast to bf16 on the GPU before its forward and backward, its
fp32 gradients go back to the host, and `torch.optim.AdamW` steps on the CPU over every
parameter — the same job as `appliance train --finetuning-type full` (docs/architecture.md).
Weights are the bench's synthetic ones (`appliance bench --finetuning-type full` trains the same);
tokens, loss, gradient clip and lr are peers_common's. One process, world size 1: nccl on CUDA, gloo on a CPU, where the "offload"
is nominal (host and device are one memory) and exists to test the script.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from appliance.bench.synthetic import SyntheticBlockSource
from benchmarks import peers_common as pc
from benchmarks.peer_fsdp2_offload import micro_batch, process_group


def build_full(setup: pc.Setup):
    """The fully_shard-ed LlamaForCausalLM (fp32 masters on the host) and its AdamW over every
    parameter, on the CPU where the sharded parameters are."""
    import transformers

    cuda = setup.device.type == "cuda"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(pc.llama_config(setup.args))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(setup.device.type, (1,))
    offload = CPUOffloadPolicy(pin_memory=cuda)
    mp = (
        MixedPrecisionPolicy(param_dtype=setup.dtype, reduce_dtype=torch.float32)
        if setup.dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    model.to_empty(device="cpu")
    fill(model, setup)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=pc.LR, betas=(0.9, 0.999), weight_decay=0.0)
    facts = {
        "finetuning_type": "full",
        "offload_policy": f"CPUOffloadPolicy(pin_memory={cuda})",
        "offload_nominal": not cuda,
        "param_dtype": str(mp.param_dtype or torch.float32).removeprefix("torch."),
        "master_dtype": "float32",
        "optimizer": "torch.optim.AdamW on the CPU over every parameter",
    }
    return model, optimizer, facts


@torch.no_grad()
def fill(model: torch.nn.Module, setup: pc.Setup) -> None:
    """The bench's synthetic weights (SyntheticBlockSource: what `appliance bench` trains), in
    the fp32 masters, and fresh RoPE tables (`to_empty` leaves buffers as garbage)."""
    source = SyntheticBlockSource(setup.args, torch.float32)
    for name, p in model.named_parameters():
        key, i = pc.base_key(name)
        source._fill(pc._local(p), key, i)
    if setup.args.tie_word_embeddings:
        model.tie_weights()
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq"):
                with torch.device(setup.device):
                    setattr(parent, child_name, type(child)(config=child.config))


PEER = pc.Peer(
    system="fsdp2-offload-full",
    label="PyTorch FSDP2 + CPUOffloadPolicy, full fine-tune, gradient checkpointing",
    build=build_full,
    micro_batch=micro_batch,
    setup_context=process_group,
)


def run(setup: pc.Setup) -> dict:
    """Build, train and time a full fine-tune; the JSON result."""
    batches = pc._batches(setup.args, setup.shape)
    tokens = sum(x.numel() for x, _ in batches)
    result = {"system": PEER.system, "label": PEER.label, "preset": setup.preset,
              "device": setup.device.type, "dtype": str(setup.dtype).removeprefix("torch."),
              "tokens_per_step": tokens}  # fmt: skip
    with process_group(setup):
        t0 = time.perf_counter()
        model, optimizer, facts = build_full(setup)
        result.update(facts, build_seconds=time.perf_counter() - t0)
        result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        losses, seconds = pc.train_steps(PEER, model, optimizer, setup, batches)
    step = sum(seconds) / len(seconds)
    result.update(losses=losses, step_seconds=step, tokens_per_second=tokens / step)
    return result


def main(argv: list[str] | None = None) -> int:
    a = pc.parser("python -m benchmarks.peer_fsdp2_full", __doc__.split("\n\n")[0]).parse_args(
        sys.argv[1:] if argv is None else argv
    )
    try:
        setup = pc.resolve(a.preset, a.device, a.steps, a.warmup)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = run(setup)
    print(
        f"{result['label']}: {result['preset']}, {result['trainable_params'] / 1e6:.4g}M trained "
        f"parameters, {result['tokens_per_second']:.4g} tokens/s; losses "
        + ", ".join(f"{x:.4f}" for x in result["losses"])
    )
    if a.json_path:
        pc.write_json(result, a.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
