"""Peer baseline: transformers + PEFT, the whole model resident on the device, gradient
checkpointing on, bf16, plain AdamW on the LoRA parameters.

On the GPU run of issue 10 (from the repository root, beside `appliance bench` and
benchmarks/peer_fsdp2_offload.py; docs/benchmarks.md, "Peers: how they are run"):

    PYTHONPATH=$PWD python -m benchmarks.peer_hf_peft --preset 13b --device cuda --json hf-13b.json
    PYTHONPATH=$PWD python -m benchmarks.peer_hf_peft --preset tiny --device cpu   # seconds

The model (`LlamaForCausalLM` of the preset's shape, made on the meta device, then materialized
on the device and filled with `appliance bench`'s own synthetic weights), the LoRA (r16, alpha 32,
dropout 0 on q, k, v, o, gate, up, down, started from the bench's adapters), the tokens and the
step are those of `appliance bench` (benchmarks/peers_common.py says how). As transformers'
Trainer does with bf16=True: base weights in bf16, adapters kept in fp32 and the forward run under
`torch.autocast(bfloat16)`. On a CPU everything is fp32 (as the bench on a CPU).

A model that does not fit (e.g. 70B's 129 GiB of bf16 weights on an 80 GB GPU) is reported as
`fits: false` with the reason (the CUDA out-of-memory error, caught, memory freed), not a crash.
"""

from __future__ import annotations

import sys

from benchmarks import peers_common as pc


def build(setup: pc.Setup):
    """The PeftModel on `setup.device` with the bench's weights, and its AdamW."""
    if setup.device.type == "cpu":
        pc.check_host_memory(setup)
    model = pc.build_meta_model(setup.args, setup.dtype)
    model.to_empty(device=setup.device)  # a shape too big for the GPU fails here (OOM)
    pc.fill_weights(model, setup.args, setup.device)
    facts = {"resident": True, "autocast": setup.dtype != pc.torch.float32}
    return model, pc.make_optimizer(model), facts


PEER = pc.Peer(
    system="hf-peft",
    label="transformers + PEFT, resident, gradient checkpointing",
    build=build,
    autocast=True,
)

DESCRIPTION = (
    "Time LoRA training of a preset's Llama shape with transformers + PEFT, the model resident "
    "on the device, gradient checkpointing on: the same model, LoRA and tokens as appliance bench."
)


def main(argv: list[str] | None = None) -> int:
    return pc.main(PEER, argv, "python -m benchmarks.peer_hf_peft", DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
