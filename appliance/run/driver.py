"""The driver: `appliance train` from config to adapter.

    setup    check every input (model, tokenizer, data, output) before anything heavy starts,
             then start embedded Ray (or join --cluster)
    train    `run.Run` creates a WeightStore per trainer node, the tokenizer workers and the
             trainers (one per GPU, data-parallel), keeps a bounded window of batches in flight,
             steps the trainers, checkpoints, recovers
    cleanup  rank 0 writes the adapter (complete, then published); stop Ray

The driver holds no tensors: batches travel from the tokenizer workers to the trainer by object
ref, weights from the store to the trainer through shared memory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from appliance.actors.weight_store import weight_store_bytes
from appliance.cluster.start import (
    check_shared_output,
    on_node,
    start_ray,
    trainer_slots,
)
from appliance.config import AUTO, TrainConfig
from appliance.engine.blocks import dtype_from_name
from appliance.errors import appliance_command, cause_chain
from appliance.interrupt import GracefulStop, RunInterrupted, stopped_at_once
from appliance.metrics.endpoint import METRICS_REPORT_INTERVAL_MS
from appliance.plan.auto import (
    CPU_AUTO_M,
    auto_micro_batches,
    gpu_micro_batch_shape,
    measure_this_gpu,
)
from appliance.plan.estimate import load_args
from appliance.plan.shape import shape_note
from appliance.run.inputs import absolute_paths, prepare, resolve_inputs
from appliance.run.loop import Run
from appliance.run.progress import Progress
from appliance.run.resume import remove_previous_run
from appliance.run.state import Inputs
from appliance.storage.output_lock import output_lock


def connect(cfg: TrainConfig, progress: Progress) -> Run:
    """Start (or join, with --cluster) Ray and check the inputs where the trainers will run."""
    import ray

    if not cfg.cluster:
        inp = prepare(cfg)
        start_ray(
            cfg, progress, weight_bytes=weight_store_bytes(inp.model_dir, inp.dtype, cfg.base_quant)
        )
        resolve_micro_batches(inp, progress)
        return Run(inp, progress)
    absolute_paths(cfg)  # config.validate refuses the demo with --cluster: paths are given
    start_ray(cfg, progress)
    slots = trainer_slots()
    used = slots[: cfg.trainers] if cfg.trainers else slots
    check_shared_output(cfg.output, used)
    resolve = ray.remote(num_cpus=0)(resolve_inputs)
    nodes = list(dict.fromkeys((s.node_id, s.address) for s in used))  # each trainer node once
    try:  # every trainer node must see the inputs; the first node's answer is the run's
        inp = ray.get([resolve.options(**on_node(n)).remote(cfg, a) for n, a in nodes])[0]
    except Exception as e:
        raise cause_chain(e)[-1] from None
    resolve_micro_batches(inp, progress)
    return Run(inp, progress, slots)


def resolve_micro_batches(inp: Inputs, progress: Progress) -> None:
    """The step's shape, where the run chooses it. `--micro-batches-per-step auto`: 4 on a CPU;
    on a GPU, measure B and P where a trainer's GPU is (a one-off Ray task, whose process then
    exits with its CUDA context) and take plan's M. Then, on a GPU with `--micro-batch-size`
    left at its default, the rows a micro-batch for the GPU at the same tokens a step
    (plan/shape.py), said in a start line. The numbers replace the config's, so run.json records
    them (and a resume keeps them: recorded, they are given)."""

    cfg = inp.cfg
    auto = cfg.micro_batches_per_step == AUTO
    if inp.device != "cuda":
        if auto:
            cfg.micro_batches_per_step = CPU_AUTO_M
            progress.note(f"--micro-batches-per-step auto: {CPU_AUTO_M} (on a CPU)")
        return
    shape_it = "micro_batch_size" not in cfg.given
    if not (auto or shape_it):
        return
    import ray

    measure = ray.remote(num_gpus=1, max_calls=1)(measure_this_gpu)
    measured = ray.get(measure.remote(inp.dtype))  # P in the run's compute dtype
    args, _ = load_args(cfg.model, None)  # config.json (with --cluster: shared path or s3://)
    shape = dict(
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        lora_rank=cfg.lora_rank,
        lora_targets=tuple(cfg.lora_targets),
        dtype_bytes=dtype_from_name(inp.dtype).itemsize,
        budget=cfg.budget_bytes(),
        base_quant=cfg.base_quant,
        finetuning_type=cfg.finetuning_type,
    )
    if auto:
        m, why = auto_micro_batches(args, measured, **shape)
        cfg.micro_batches_per_step = m
        progress.note(
            f"--micro-batches-per-step auto: {m} ({why}; measured B = "
            f"{measured['h2d_bytes_per_second'] / 1e9:.1f} GB/s, P = "
            f"{measured['flops_per_second'] / 1e12:.0f} TFLOP/s on {measured['name']})"
        )
    if shape_it:
        was = (cfg.micro_batch_size, cfg.micro_batches_per_step)
        rows, m, why = gpu_micro_batch_shape(args, measured, cfg.micro_batches_per_step, **shape)
        cfg.micro_batch_size, cfg.micro_batches_per_step = rows, m
        progress.note(shape_note(rows, m, cfg.seq_len, why, was))


def _record_stop(run: Run) -> None:
    """run.json says a run stopped at once (a second Ctrl-C, or one before its step loop) was
    interrupted: its last checkpoint is where --resume continues."""
    try:
        run.record("interrupted", {"stopped_at_once": True})
    except BaseException:  # noqa: BLE001 - a third Ctrl-C, or the output failing: it stops
        pass


def failed_here(error: BaseException, at_once: bool) -> bool:
    """Whether a run that raised `error` failed (rather than being stopped by the user)."""
    return isinstance(error, Exception) and not isinstance(error, RunInterrupted) and not at_once


def _record_failure(run: Run, error: BaseException) -> None:
    """run.json says a run that raised failed, and why, so the next `appliance train` into its
    output does not show it as running. Its checkpoints stay: `--resume` continues it."""
    cause = cause_chain(error)[-1]  # an actor's DataError, not Ray's wrapper with its traceback
    try:
        run.record("failed", {"error": f"{type(cause).__name__}: {cause}"[:2000]})
    except Exception:  # noqa: BLE001 - the output itself may be what failed; the error is raised
        pass


def _let_metrics_report(cfg: TrainConfig) -> None:
    """Wait one metrics report interval before Ray shuts down: each process hands its numbers to
    its node's metrics agent periodically, so without this the last step's and the final
    checkpoint's numbers would die with the processes, unseen by Prometheus."""

    ms = METRICS_REPORT_INTERVAL_MS  # what the embedded Ray is started with
    if cfg.cluster:  # the cluster's own setting, as Ray reads it (its default is 10 s)
        ms = int(os.environ.get("RAY_metrics_report_interval_ms", "10000"))
    # for tests, whose runs nothing scrapes after their end (tests/conftest.py sets it to 0)
    ms = int(os.environ.get("APPLIANCE_LAST_METRICS_WAIT_MS", ms))
    try:
        time.sleep(ms / 1e3)
    except KeyboardInterrupt:  # the run is complete, its adapter written: a stop skips the wait
        pass


def train(cfg: TrainConfig, progress: Progress | None = None) -> dict:
    """Run `appliance train` and return its summary."""
    import ray

    progress = progress or Progress(cfg.log_format)
    t0 = time.perf_counter()
    started_here = not ray.is_initialized()
    demo = cfg.model is None
    # the --output is locked for the whole run (the demo's own temp output needs no lock)
    recorded = False  # whether this run wrote its run.json: a failure is recorded there then
    lock = output_lock(cfg.output, progress.note) if cfg.output else contextlib.nullcontext()
    try:
        with lock:
            run = connect(cfg, progress)
            run.lease = lock  # an S3 lease taken over stops the run's writes (Run.check_lease)
            run.demo = demo
            cfg = run.cfg
            if cfg.overwrite:
                remove_previous_run(cfg.output)  # before the new run writes anything
            if (nothing := run.nothing_left_to_train()) is not None:
                progress.note(nothing)
                return {"steps": 0, "output": cfg.output, "nothing_left_to_train": True}
            run.record("running")
            recorded = True
            for note in run.inp.notes:
                progress.note(note)
            run.create_actors()
            if run.has_eval():  # built now: a validation set with nothing to score fails here,
                run.eval_refs()  # not at the first eval, after hours of training
            before = run.evaluate() if demo and run.has_eval() else None  # the drop it makes
            # after ray.init, which sets its own SIGTERM handler. Ctrl-C/SIGTERM: checkpoint at
            # the next step boundary; once the last step is done, the run just finishes
            with GracefulStop() as stop:
                run.interrupt = stop
                run.train()
                after = run.final_eval_loss()
                run.finish(after)
            if started_here:
                _let_metrics_report(cfg)
    except BaseException as e:
        at_once = stopped_at_once(e)  # a second Ctrl-C, or one before the step loop
        if recorded:  # its tracked runs (--report-to) end as the run did
            with contextlib.suppress(Exception):
                run.report.close("failed" if failed_here(e, at_once) else "interrupted")
        if recorded and at_once:  # not left `running`: its checkpoints are what --resume takes
            _record_stop(run)
        elif recorded and isinstance(e, Exception) and not isinstance(e, RunInterrupted):
            _record_failure(run, e)  # interrupted at a step: run.py recorded it
        # a failed demo leaves nothing worth keeping (a stopped one can be resumed)
        failed = isinstance(e, Exception) and not isinstance(e, RunInterrupted)
        if demo and cfg.model is not None and failed and not at_once:
            shutil.rmtree(Path(cfg.model).parent, ignore_errors=True)
        if at_once and not isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # Ray's SystemError around it: what it is
        raise
    finally:
        progress.stop()  # the live table stops before any error line is printed
        if started_here and ray.is_initialized():
            ray.shutdown()  # also ends this job's actors on a cluster (Ctrl-C included)
    summary = {
        "steps": run.state.step,
        "final_loss": run.state.losses[-1] if run.state.losses else None,
        "output": cfg.output,
        "seconds": time.perf_counter() - t0,
        "target_tokens": run.state.target_tokens,
        "skipped_records": sum(run.state.skipped.values()),
        "target_share": run.state.target_tokens / max(run.state.row_tokens, 1),
    }
    if run.state.skipped_steps:  # float16 only: overflowed steps, no update (loss_scale.py)
        summary["skipped_steps"] = run.state.skipped_steps
    if after is not None:
        summary["eval_loss"] = after
    if before is not None:
        summary.update(
            eval_loss_before=before, eval_loss_after=after, eval_loss_drop=1 - after / before
        )
    progress.finish(summary)
    if demo:
        root = Path(cfg.model).parent  # type: ignore[arg-type]
        progress.note(
            f"try the adapter: {appliance_command()} eval --adapter {cfg.output} (its run's model, "
            "--seq-len and held-out data come with it)\n"
            f"(the demo's model and corpus are in {root}: delete it when done)"
        )
    return summary
