"""The streamed step and GPU memory, in plain PyTorch (no Ray here).

step.py            StreamedEngine: one optimizer step over M micro-batches, layer-major —
                   each block copied host → GPU once per pass, forward for every micro-batch,
                   then recompute + backward block by block; LoRA gradients and AdamW
device_weights.py  the blocks on the device: copies on a side stream, page-locked host memory
expert_streaming.py  a MoE block's experts copied only when tokens are routed to them
saved_inputs.py    block inputs saved for the backward, offloaded to host memory
blocks.py          a block's tensors as one flat buffer (the layout the store and GPU share)
memory.py          how much of the GPU the step needs, and how many blocks stay resident
loss_scale.py      the fp16 loss scaler
full.py            FullFinetuneEngine: every weight trains (--finetuning-type full): weight
                   gradients off the device per block, AdamW on the host beside the GPU
host_adam.py       HostAdamW: fp32 master weights and AdamW moments in host memory, per block
batches.py         a step's inputs and outputs: MicroBatch, target counts, batch sizes, StepStats
"""

from appliance.engine.batches import StepStats
from appliance.engine.memory import MemoryPlan, plan_memory
from appliance.engine.step import StreamedEngine

__all__ = ["MemoryPlan", "StepStats", "StreamedEngine", "plan_memory"]
