"""The commands about the machine, before or beside a run: `bench` (the streamed step timed),
`plan` (memory, time and cost from config.json alone), `doctor` (checks this box). Each imports
the package that does its work inside its function (start-up time: see main.py)."""

from __future__ import annotations

import sys

import click

from appliance.cli.common import friendly_errors, train_flag_help
from appliance.config import (
    CHOICES,
    DEFAULT_METRICS_PORT,
    TrainConfig,
)
from appliance.hardware.gpus import GPUS as GPU_CLASSES


@click.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    short_help="Time the streamed step against its floor and resident training.",
)
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def bench(options: tuple[str, ...]) -> None:
    """Streamed vs resident step time against the floor max(W/B_h2d, F/P) (--help: options)."""
    from appliance.bench.cli import main as bench_main

    # one parser for both entry points: bench's own (`python -m appliance.bench`)
    sys.exit(bench_main(list(options), prog="appliance bench"))


PLAN_SHAPE = ("seq_len", "micro_batch_size", "micro_batches_per_step")  # train's defaults
PLAN_DTYPES = tuple(d for d in CHOICES["dtype"] if d != "auto")  # estimate.DTYPES


@click.command("plan", short_help="Memory, time and cost of a run, before renting a GPU.")
@click.option("--model", default=None, help="Model directory or s3:// prefix (config.json only).")
@click.option("--preset", default=None, help="A bench preset instead of --model (tiny, 7b, ...).")
@click.option(
    "--gpu",
    "gpu",
    type=click.Choice(list(GPU_CLASSES), case_sensitive=False),
    required=True,
    help="GPU class: its memory, host link, FLOP rate and instance (docs/plan.md's table).",
)
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs (trainers) on one node.")
@click.option(
    "--seq-len",
    type=int,
    default=TrainConfig.seq_len,
    show_default=True,
    help=train_flag_help("seq_len"),
)
@click.option(
    "--micro-batch-size",
    type=int,
    default=TrainConfig.micro_batch_size,
    show_default=True,
    help=train_flag_help("micro_batch_size"),
)
@click.option(
    "--micro-batches-per-step",
    default=str(TrainConfig.micro_batches_per_step),
    show_default=True,
    metavar="[N|auto]",
    help="Micro-batches per optimizer step (M), or auto: the smallest M within 10% of "
    "compute-bound that fits.",
)
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default=TrainConfig.base_quant,
    show_default=True,
    help=train_flag_help("base_quant"),
)
@click.option(
    "--lora-rank",
    type=int,
    default=TrainConfig.lora_rank,
    show_default=True,
    help=train_flag_help("lora_rank").rstrip(".") + ", on all seven projections.",
)
@click.option("--gpu-memory-budget", default=None, help="e.g. 20GiB (default: 90% of the card).")
@click.option("--tokens", type=int, default=None, help="Tokens to train on (for time and cost).")
@click.option("--steps", type=int, default=None, help="Optimizer steps (instead of --tokens).")
@click.option("--price-per-hour", type=float, default=None, help="$ per GPU-hour (default: table).")
@click.option(
    "--dtype",
    type=click.Choice(PLAN_DTYPES),
    default="bfloat16",
    show_default=True,
    help="Compute dtype (train's auto is bfloat16 on a GPU with bf16).",
)
@click.option(
    "--finetuning-type",
    type=click.Choice(CHOICES["finetuning_type"]),
    default=TrainConfig.finetuning_type,
    show_default=True,
    help="full: every weight trains (host memory for masters and moments, gradients device→host, "
    "the CPU's AdamW).",
)
@click.option("--freeze-embeddings", is_flag=True, help=train_flag_help("freeze_embeddings"))
@click.option("--h2d-gbps", type=float, default=None, help="Measured B (GB/s), e.g. from doctor.")
@click.option("--tflops", type=float, default=None, help="Measured P (TFLOP/s), e.g. from doctor.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def plan_cmd(model, preset, gpu, micro_batches_per_step, gpu_memory_budget, as_json, **kw) -> None:
    """Memory, time and cost of a run from config.json alone (no weights, no GPU needed).

    The shape defaults to train's (--seq-len, --micro-batch-size, --micro-batches-per-step), so
    `plan --model X` describes `train --model X`. Exits 1 when the run does not fit (GPU memory
    or host RAM), naming what to change."""
    from click.core import ParameterSource

    from appliance.plan.estimate import plan_input
    from appliance.plan.report import run_plan
    from appliance.storage.hub import resolve_model

    ctx = click.get_current_context()
    kw["train_defaults"] = tuple(
        n for n in PLAN_SHAPE if ctx.get_parameter_source(n) == ParameterSource.DEFAULT
    )
    model = resolve_model(model) if model else model  # a hub id: its local-cache snapshot
    p = plan_input(model, preset, gpu, micro_batches_per_step, gpu_memory_budget, **kw)
    sys.exit(0 if run_plan(p, as_json)["fits"] else 1)


@click.command("doctor")
@click.option("--model", default=None, help="Model directory or s3:// prefix (config.json only).")
@click.option("--preset", default=None, help="A bench preset instead of --model.")
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default="none",
    show_default=True,
    help="Count the weight store as train --base-quant would store it.",
)
@click.option(
    "--device",
    type=click.Choice(CHOICES["device"]),
    default="auto",
    show_default=True,
    help="The device train would use: auto takes CUDA when a GPU is visible; cuda fails the "
    "gpus check when none is; cpu skips what only a GPU run needs (page-locking).",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="The metrics port train would be given: checked to be free. Without it, the port train "
    f"takes by default ({DEFAULT_METRICS_PORT}, or the next free one).",
)
@click.option(
    "--tokens-per-step",
    type=int,
    default=None,
    help="A mixture-of-experts model: one trainer's tokens a step, for the share of experts "
    "expected to move (default: train's seq-len × micro-batch size × micro-batches).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def doctor_cmd(model, preset, base_quant, device, metrics_port, tokens_per_step, as_json) -> None:
    """Check this box: versions, GPUs, /dev/shm, RAM, memlock, Triton, disk, bandwidth, port, Ray, S3."""
    from appliance.plan.doctor import run_doctor
    from appliance.storage.hub import resolve_model

    model = resolve_model(model) if model else model  # a hub id: its local-cache snapshot
    sys.exit(run_doctor(model, preset, base_quant, device, metrics_port, as_json, tokens_per_step))
