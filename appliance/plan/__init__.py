"""Before a run: will it fit, and how fast will it go.

estimate.py  GPU and host memory and the step's time for a model, card and shape
report.py    `appliance plan`: the estimate at the chosen micro-batches, as JSON or text
fixes.py     what to change when it does not fit
auto.py      --micro-batches-per-step auto, measured on this GPU
doctor.py    `appliance doctor`: this machine checked against what a run needs
software.py  doctor's checks of the box's software and devices (Python, torch, GPUs, Triton)
experts.py   a mixture of experts: the share of a streamed block's experts expected to move
full.py      a full fine-tune's host side: memory per parameter, gradients device→host, AdamW
"""

from appliance.plan.estimate import PlanInput, evaluate, plan_input
from appliance.plan.report import format_plan, make_plan

__all__ = ["PlanInput", "evaluate", "format_plan", "make_plan", "plan_input"]
