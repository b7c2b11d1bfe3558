"""One training run on Ray: the actors, the step loop, checkpoints and recovery.

`driver.py` checks the inputs and starts (or joins) Ray; a `Run` then owns the actors (started
by launch.py):

    WeightStore   one per trainer node, the base model in shared memory (survives restarts)
    ShardWorker   N tokenizer workers, each packing a disjoint shard into micro-batches
    Trainer       R data-parallel ranks (one per GPU), each the streamed engine + LoRA +
                  optimizer, beside its node's store; one torch.distributed group

and drives them: a bounded window of batch requests in flight; each optimizer step hands rank r
the r-th M of the step's R×M micro-batches; checkpoints (rank 0's state) every
--checkpoint-every steps; recovery from a dead trainer (all ranks recreated, a fresh group,
restored) or worker (recreated at its cursor).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from appliance.actors.full_trainer import FullTrainer
from appliance.actors.tokenize_worker import ACTOR_OPTIONS
from appliance.actors.trainer import Trainer, resolve_kernels
from appliance.adapter import model_card
from appliance.adapter.evaluate import validation_batches
from appliance.cluster.start import Slot
from appliance.config import CHECKPOINT_MINUTES
from appliance.engine.schedule import lr_at, warmup_for
from appliance.errors import StorageError, TrainingError, appliance_command, cause_chain
from appliance.interrupt import GracefulStop, RunInterrupted
from appliance.metrics.recorders import DriverMetrics
from appliance.run.failures import RestartsExhausted, gather, unrecoverable
from appliance.run.feed import (
    count_batches,
    data_summary,
    length_notes,
    schedule,
    skipped_warning,
    small_data,
    worker_kwargs,
)
from appliance.run.history_log import eval_record, step_record
from appliance.run.launch import actor_counts, make_trainers, make_worker, start_stores
from appliance.run.progress import Progress
from appliance.run.record import read_run_file, write_run_file
from appliance.run.report import RunReport
from appliance.run.state import Inputs, RunState
from appliance.storage.checkpoints import (
    CONFIG_FILE,
    DRIVER_STATE,
    CheckpointError,
    checkpoints_uri,
    json_bytes,
    list_checkpoints,
    load_latest_checkpoint,
)
from appliance.storage.history import read_chain, write_segment

# ---------------------------------------------------------------------- the run


class Run:
    """One training run on Ray (embedded, or a cluster given by --cluster)."""

    trainer_class: type = Trainer  # the actor class of each rank (tests subclass it to observe)

    def __init__(self, inp: Inputs, progress: Progress, slots: list[Slot] | None = None):
        self.inp, self.cfg, self.progress = inp, inp.cfg, progress
        self.full = self.cfg.finetuning_type == "full"  # every weight trains (full_trainer.py)
        if self.full and self.trainer_class is Trainer:
            self.trainer_class = FullTrainer
        self.slots = slots  # --cluster: where trainers can go (start.trainer_slots)
        self.state = RunState()
        self.metrics = DriverMetrics()
        self.restarts = 0
        self.trained = False
        self.interrupt: GracefulStop | None = None  # set by the driver: Ctrl-C/SIGTERM requests
        self.cut_said = False  # a record cut to keep memory bounded: said once a run
        self.lease: Any = None  # the output's lock (set by the driver): S3Lease.check
        # the history the checkpoints hold (storage/history.py): its last segment, and how many
        # steps' losses and validation losses it holds
        self.history: tuple[str | None, int, int] = (None, 0, 0)
        self.last_checkpoint = time.monotonic()  # for the time-based default --checkpoint-every
        self._eval_refs: list | None = None  # the validation micro-batches, in the object store
        # history.jsonl and --report-to's trackers (report.py); a resumed run's tracked runs go on
        previous = (read_run_file(str(self.cfg.output)) or {}) if self.cfg.resume else {}
        self.report = RunReport(self.cfg, progress.note, previous.get("tracking"))
        self.steps_per_epoch: float | None = None  # optimizer steps in one pass over the data
        self.demo = False  # the built-in demo (set by the driver): it repeats its corpus on purpose

    # ------------------------------------------------------------ setup

    def nothing_left_to_train(self) -> str | None:
        """--resume of a run whose latest checkpoint already reaches its length (--steps, or the
        steps its --epochs came to): the note that says so, before anything loads or is written,
        so run.json and the model card keep the flags the run trained with. None otherwise (and
        for --epochs other than the checkpoint's, which only counting them can tell)."""
        cfg = self.cfg
        if not cfg.resume:
            return None
        ckpt = load_latest_checkpoint(cfg.output, only=(DRIVER_STATE,))
        if ckpt is None:
            return None
        before = json.loads(ckpt.files[DRIVER_STATE])
        if cfg.steps:
            total, length = int(cfg.steps), f"--steps {cfg.steps}"
        elif "total_steps" in before and before.get("epochs") == (cfg.epochs or 1):
            total, length = int(before["total_steps"]), f"--epochs {before['epochs']}"
        else:
            return None
        if before["step"] < total:
            return None
        return (
            f"--resume: the run is at step {before['step']}, which {length} ({total} steps in "
            "all) already reaches: nothing is left to train, and the run is left as it is. "
            "--steps counts the run's steps from its start: give more to train further"
        )

    def create_actors(self) -> None:
        """Trainer and worker counts (a resumed run keeps its own), one weight store per trainer
        node, the data schedule, then the trainers (in one group) and, from the resumed state if
        any, the tokenizer workers."""
        import ray

        cfg, inp = self.cfg, self.inp
        # the driver reads only its own state of the checkpoint here; rank 0 reads the rest
        ckpt = load_latest_checkpoint(cfg.output, only=(DRIVER_STATE,)) if cfg.resume else None
        if ckpt is None:
            self.rewind_log()  # a fresh run: its history starts empty
        if cfg.resume and ckpt is None:
            self.progress.note(
                f"--resume: {cfg.output} has no checkpoint yet (its run stopped before the "
                "first): starting that run from step 0"
            )
        before = json.loads(ckpt.files[DRIVER_STATE]) if ckpt else {}
        R, self.ranks, self.num_workers = actor_counts(inp, self.slots, before)
        self.num_trainers = R
        # the resolved config, as used: run.json and every checkpoint's config.json say so
        cfg.device, cfg.dtype = inp.device, inp.dtype
        cfg.trainers, cfg.tokenize_workers = R, self.num_workers

        self.stores, self.handles = start_stores(inp, self.ranks, self.progress)
        self.epochs = None if cfg.steps else (cfg.epochs or 1)
        G = R * cfg.micro_batches_per_step  # micro-batches per optimizer step, all ranks
        shards = [worker_kwargs(inp, w, self.num_workers, 1) for w in range(self.num_workers)]
        figures = None  # what each worker's shard holds (feed.count_batches)
        if self.epochs is not None:  # a pass of the workers' own, where they run
            count = ray.remote(**ACTOR_OPTIONS)(count_batches)
            figures = ray.get([count.remote(shard) for shard in shards])
        elif small_data(inp) and not cfg.cluster:  # seconds, here: said before the first step
            figures = [count_batches(shard) for shard in shards]
        if figures is not None:
            per_epoch = [f["batches"] for f in figures]
            self.steps_per_epoch = sum(per_epoch) / G
            for line in data_summary(figures, inp, G):
                self.progress.note(line)
        if self.epochs is None:
            self.counts = None
            self.total_steps = int(cfg.steps)
        else:
            self.counts = [n * self.epochs for n in per_epoch]
            self.total_steps = math.ceil(sum(self.counts) / G)
        cfg.warmup_steps = warmup_for(self.total_steps, cfg.warmup_steps, cfg.warmup_ratio)
        for line in length_notes(cfg, self.total_steps, self.steps_per_epoch, G, self.demo):
            self.progress.note(line)
        self.order = schedule(self.counts, self.num_workers, self.total_steps * G)
        try:
            self.trainers = self._make_trainers()
            if ckpt is not None:
                self.restore()
                self.metrics.restart("driver")  # this process continues a killed one's run
        except Exception as e:  # noqa: BLE001 - an actor that cannot start is not retried here
            raise unrecoverable(e) or e from None
        if ckpt is not None and self.state.step >= self.total_steps:
            length = f"--steps {cfg.steps}" if cfg.steps else f"--epochs {self.epochs}"
            self.progress.note(
                f"--resume: the run is at step {self.state.step}, which {length} "
                f"({self.total_steps} steps in all) already reaches: nothing is left to train. "
                "--steps counts the run's steps from its start: give more to train further"
            )
        self.workers = [self._make_worker(w) for w in range(self.num_workers)]
        self.report.open_trackers(self.state.step)
        self.progress.note(
            f"started {R} trainer{'s' if R > 1 else ''} and {self.num_workers} tokenizer "
            f"worker{'s' if self.num_workers > 1 else ''}"
        )
        self.record("running")  # now with the resolved config

    def _make_trainers(self) -> list:
        return make_trainers(self.trainer_class, self.inp, self.ranks, self.handles)

    def _make_worker(self, w: int):
        cursor = self.state.cursors.get(w)
        return make_worker(self.inp, w, self.num_workers, self.epochs, cursor)

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        """Rank 0 writes it (every rank holds the same adapter and optimizer state), with the
        driver's state and the run's config beside its own: the big files never come here."""
        import ray

        self.check_lease()  # its lease taken over: another run writes the output now
        t0 = time.perf_counter()
        self.report.flush()  # history.jsonl holds every step this checkpoint holds, first
        st, (last, saved, saved_evals) = self.state, self.history
        segment = write_segment(  # only what came since the last checkpoint: the history, once
            checkpoints_uri(self.cfg.output),
            last,
            saved,
            st.losses[saved:],
            st.eval_losses[saved_evals:],
        )
        driver = {
            **st.to_json(),
            "losses": [],  # in the history's segments
            "eval_losses": st.eval_losses[-1:],  # the last, for the model card of this step
            "history": segment,
            "history_steps": len(st.losses),
            "history_evals": len(st.eval_losses),
            "trainers": self.num_trainers,
            "tokenize_workers": self.num_workers,
            "epochs": self.epochs,  # with total_steps: a resume knows the run's length up front
            "total_steps": self.total_steps,
        }
        files = {DRIVER_STATE: json_bytes(driver), CONFIG_FILE: json_bytes(self.cfg.to_dict())}
        cfg, step = self.cfg, self.state.step
        save = self.trainers[0].save_checkpoint.remote(
            cfg.output, step, files, cfg.keep_checkpoints
        )
        ray.get(save)
        self.history = (segment, len(st.losses), len(st.eval_losses))
        self.metrics.checkpoint_seconds(time.perf_counter() - t0)
        self.last_checkpoint = time.monotonic()

    def checkpoint_due(self) -> bool:
        """After a step: at the end, every --checkpoint-every steps, or (flag unset) at the first
        step boundary CHECKPOINT_MINUTES after the last checkpoint."""
        step, every = self.state.step, self.cfg.checkpoint_every
        if step == self.total_steps:
            return True
        if every:
            return step % every == 0
        return time.monotonic() - self.last_checkpoint >= CHECKPOINT_MINUTES * 60

    def stop_if_asked(self, checkpointed: bool) -> None:
        """After a step: when SIGINT/SIGTERM asked to stop, make sure this step is checkpointed,
        then raise RunInterrupted saying where the run is and how to go on."""

        asked = self.interrupt.requested if self.interrupt else None
        if asked is None or self.state.step == self.total_steps:
            return  # the last step is checkpointed anyway; the run ends by itself
        if not checkpointed:
            self.save_checkpoint()
        out, step = self.cfg.output, self.state.step
        self.record("interrupted", {"steps": step, "losses": self.state.losses})
        self.report.close("interrupted")
        cluster = {None: "", "auto": " --cluster"}.get(
            self.cfg.cluster, f" --cluster {self.cfg.cluster}"
        )
        raise RunInterrupted(
            f"interrupted by {asked.name} after step {step}/{self.total_steps}: checkpoint "
            f"step-{step:06d} written in {checkpoints_uri(out)}\n"
            f"resume with: {appliance_command()} train --output {out} --resume{cluster}",
            130,  # the contract for both signals: 130, "stopped by the user"
        )

    def restore(self) -> None:
        """Put every trainer and the run state back to the latest good checkpoint (the start
        when there is none); the weight stores are untouched. Rank 0 reads the checkpoint and
        loads it; the other ranks load its trainer state from the object store (one copy)."""
        import ray

        found = ray.get(self.trainers[0].restore_latest_checkpoint.remote(self.cfg.output))
        if found is None:
            self.state, self.history = RunState(), (None, 0, 0)
            self.rewind_log()
            return
        for problem in found["skipped"]:
            self.progress.note(f"warning: skipped a damaged checkpoint: {problem}")
        driver = json.loads(found["files"][DRIVER_STATE])
        self.state = RunState.from_json(driver)
        if driver.get("history"):  # the losses are in the history's segments (history.py)
            try:
                self.state.losses, self.state.eval_losses = read_chain(
                    checkpoints_uri(self.cfg.output), driver["history"], driver["history_steps"]
                )
            except (ValueError, KeyError, StorageError) as e:
                raise CheckpointError(
                    f"{found['name']}: its loss history cannot be read ({e}); --resume needs "
                    "the checkpoints/history/ directory the run wrote beside its checkpoints"
                ) from None
            self.history = (driver["history"], len(self.state.losses), driver["history_evals"])
        else:  # a checkpoint from before the segments: its driver state holds it all
            self.history = (None, 0, 0)
        state = found["state"]  # [ref] with several ranks
        gather([t.load_state_bytes.remote(state[0]) for t in self.trainers[1:]])
        self.progress.note(f"resumed from {found['name']} (step {self.state.step})")
        self.rewind_log()

    def rewind_log(self) -> None:
        """history.jsonl and the trackers to the run's state (the steps after it are trained
        again): report.py."""
        self.report.rewind(self.state.step, self.state.losses, self.state.eval_losses)

    def epoch_at(self, step: int) -> float | None:
        """Passes over the data after `step` steps (None when the data was not counted)."""
        return round(step / self.steps_per_epoch, 4) if self.steps_per_epoch else None

    # ------------------------------------------------------------ faults

    def recover(self, error: BaseException) -> None:
        """Recreate what died and rewind to a consistent point, or raise.

        A dead trainer: every trainer is recreated (a fresh group) over the same weight stores
        and restored from the last checkpoint. A dead tokenizer worker: the workers are recreated
        from the cursors of the last batches the trainers consumed (with several trainers the
        trainers are reset too: the ranks that got their batches are inside a collective the
        others never join). User errors, actors that cannot start, and bugs are not retried.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        fatal = unrecoverable(error)
        if fatal is not None:
            raise fatal
        chain = cause_chain(error)
        if not any(isinstance(c, RayActorError) for c in chain):
            raise error
        trainer_died = isinstance(error, RayActorError) and not isinstance(error, RayTaskError)
        kind = "trainer" if trainer_died else "tokenizer"
        if self.restarts >= self.cfg.max_restarts:  # this failure is not a restart
            raise RestartsExhausted(
                f"giving up after {self.cfg.max_restarts} restarts "
                f"(--max-restarts); last failure ({kind}): {chain[-1]}"
            )
        self.restarts += 1
        self.progress.restarts = self.restarts
        self.metrics.restart(kind)
        self.progress.note(
            f"{kind} failed ({type(chain[-1]).__name__}); restart "
            f"{self.restarts}/{self.cfg.max_restarts}"
        )
        if trainer_died or self.num_trainers > 1:
            for t in self.trainers:
                ray.kill(t)
            self.trainers = self._make_trainers()
            self.restore()
        for w in self.workers:  # queued requests are void: every worker restarts at its cursor
            ray.kill(w)
        self.workers = [self._make_worker(w) for w in range(self.num_workers)]

    def _retrying(self, call: Callable[[], Any]) -> Any:
        """`call()`, through recovery when an actor dies; a restore that rewound a trained run
        trains it to the end again first."""
        while True:
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - recover() re-raises what it cannot handle
                self.recover(e)
                if self.trained and self.state.step < self.total_steps:
                    self.train()

    # ------------------------------------------------------------ the step loop

    def train(self) -> RunState:
        """The step loop with a bounded window of batch requests in flight: each optimizer step
        takes R×M micro-batches in schedule order, rank r the r-th M of them."""
        cfg = self.cfg
        G = self.num_trainers * cfg.micro_batches_per_step
        window = cfg.prefetch * G  # micro-batches requested ahead of the trainers
        pending: deque = deque()  # (worker, ref) requested and not consumed, schedule order
        requested = self.state.consumed
        self.progress.start(self.total_steps, self.state.step)
        while self.state.step < self.total_steps:
            st = self.state
            while requested < len(self.order) and requested - st.consumed < window + G:
                w = self.order[requested]
                pending.append((w, self.workers[w].next_batch.remote()))
                requested += 1
            refs = [pending.popleft()[1] for _ in range(min(G, len(self.order) - st.consumed))]
            lr = lr_at(
                st.step,
                lr=cfg.lr,
                warmup_steps=cfg.warmup_steps,
                total_steps=self.total_steps,
                min_lr_ratio=cfg.min_lr_ratio,
            )
            try:
                self.check_lease()  # each step: a run whose lease was taken over stops
                stats = self._step(refs, lr)
                self._check_finite(st.step + 1, stats, lr)
                st.step += 1
                st.consumed += len(refs)
                st.cursors.update({int(w): c for w, c in stats["cursors"].items()})
                st.losses.append(stats["loss"])
                st.skipped_steps += bool(stats.get("skipped_step"))
                stats["skipped_steps"] = st.skipped_steps  # the run's so far, for the display
                st.target_tokens += stats["target_tokens"]
                st.row_tokens += stats["tokens"]
                # the share of the rows' positions that are targets: padding, prompts and
                # non-assistant turns are not (low for chat data however well it is packed)
                stats["target_share"] = st.target_tokens / max(st.row_tokens, 1)
                self.metrics.target_share(stats["target_share"])
                st.skipped.update({int(w): n for w, n in stats["skipped_records"].items()})
                for note in stats.get("cut_notes", ())[:1]:
                    if not self.cut_said:
                        self.progress.note(f"warning: {note}")
                        self.cut_said = True
                st.tokenizer_pids.update(stats["pids"])
                stats["batches_in_flight"] = len(pending)
                self.metrics.batches_in_flight(len(pending))
                for w in range(self.num_workers):
                    self.metrics.queue_depth(w, sum(1 for v, _ in pending if v == w))
                epoch = stats["epoch"] = self.epoch_at(st.step)
                records = [step_record(st.step, epoch, stats)]
                if self.eval_due(st.step):
                    stats["eval_loss"] = self._eval_loss()
                    st.eval_losses.append([st.step, stats["eval_loss"]])
                    self.metrics.eval_loss(stats["eval_loss"])
                    records.append(eval_record(st.step, epoch, stats["eval_loss"]))
                self.report.append(records)
                self.progress.step(st.step, stats)
                due = self.checkpoint_due()
                if due:
                    self.save_checkpoint()
                self.stop_if_asked(checkpointed=due)
            except RunInterrupted:
                raise
            except Exception as e:  # noqa: BLE001 - recover() re-raises what it cannot handle
                self.recover(e)
                pending.clear()
                requested = self.state.consumed
        skipped = sum(self.state.skipped.values())
        if skipped and not self.trained:  # once: which records were left out, and why
            self.progress.note(skipped_warning(skipped, self.workers, self.state.cursors))
        self.trained = True
        return self.state

    def _check_finite(self, step: int, stats: dict, lr: float) -> None:
        """TrainingError when step `step`'s loss is not finite: its update made the adapter NaN
        (or will), and every step after it would train on that; a run that went on would publish
        an adapter of NaNs as complete. float16's overflowed steps (no update) are the loss
        scaler's to skip, not errors. The last checkpoint stays, before the bad step."""
        loss = stats["loss"]
        if math.isfinite(loss) or stats.get("skipped_step"):
            return
        import ray

        saved = list_checkpoints(self.cfg.output)
        kept = f"its last checkpoint, step {saved[-1].step}, is kept" if saved else "no checkpoint"
        try:  # which weight, if one is: what to fix differs
            bad = ray.get(next(iter(self.stores.values())).first_non_finite.remote())
        except Exception:  # noqa: BLE001 - the error below is the one to raise either way
            bad = "?"
        if bad not in (None, "?"):
            raise TrainingError(
                f"step {step}: the loss is {loss}: the base model's weight {bad} holds inf or NaN "
                f"(a damaged download, or a model saved from a run that diverged). The run stops "
                f"here ({kept}): fetch the model again, or give another"
            )
        again = "resume with" if saved else "run it again with"
        cause = "the data or" if bad is None else "the base model's weights or the data hold"
        raise TrainingError(
            f"step {step}: the loss is {loss}: {cause} values that are not finite, or --lr "
            f"{lr:g} is too high for them. The run stops here ({kept}): {again} a lower --lr"
        )

    def _step(self, refs: list, lr: float) -> dict:
        """One optimizer step on every rank; rank 0's stats (loss, grad norm and target tokens
        are the global batch's), with tokens, cursors, pids and skipped records of all ranks."""
        M = self.cfg.micro_batches_per_step
        shares = [refs[r * M : (r + 1) * M] for r in range(self.num_trainers)]  # maybe empty
        per_rank = gather(
            [
                t.step.remote(s, lr, r * M)
                for r, (t, s) in enumerate(zip(self.trainers, shares, strict=True))
            ]
        )
        stats = dict(per_rank[0])
        stats["tokens"] = sum(s["tokens"] for s in per_rank)
        for key in ("cursors", "skipped_records"):  # rank order is schedule order: later wins
            stats[key] = {w: v for s in per_rank for w, v in s[key].items()}
        stats["pids"] = sorted({p for s in per_rank for p in s["pids"]})
        return stats

    # ------------------------------------------------------------ the end

    def has_eval(self) -> bool:
        """Is there validation data: --eval-data (the demo's held-out corpus too), --eval-split?"""
        return bool(self.cfg.eval_data or self.cfg.eval_split)

    def eval_due(self, step: int) -> bool:
        """Validate after `step`: every --eval-every steps, and after the last step."""
        if not self.has_eval():
            return False
        every = self.cfg.eval_every
        return step == self.total_steps or bool(every and step % every == 0)

    def eval_refs(self) -> list:
        """The validation set as packed micro-batches in the object store (built once)."""
        import ray

        if self._eval_refs is None:
            batches = validation_batches(
                self.cfg, self.inp, warn=lambda m: self.progress.note(f"validation: {m}")
            )
            self._eval_refs = [ray.put(b) for b in batches]
        return self._eval_refs

    def _eval_loss(self) -> float:
        """Mean next-token loss over the validation set's target tokens, via rank 0."""
        import ray

        nll, n = ray.get(self.trainers[0].eval_loss.remote(self.eval_refs()))
        return nll / max(n, 1)

    def evaluate(self) -> float:
        """The validation loss now (recovering from a dead trainer like a step does)."""
        return self._retrying(self._eval_loss)

    def final_eval_loss(self) -> float | None:
        """The validation loss after the last step (the step loop computed it)."""
        last = self.state.eval_losses[-1] if self.state.eval_losses else None
        if last is not None and last[0] == self.state.step:
            return float(last[1])
        return self.evaluate() if self.has_eval() else None

    def finish(self, eval_loss: float | None = None) -> None:
        """Publish the adapter, its model card, and run.json's `complete` record (last)."""
        import ray

        self.check_lease()
        self._retrying(lambda: ray.get(self.trainers[0].write_adapter.remote(self.cfg.output)))
        loads = sum(
            s["load_count"] for s in ray.get([s.stats.remote() for s in self.stores.values()])
        )
        done = {
            "steps": self.state.step,
            "losses": self.state.losses,
            "restarts": self.restarts,
            "skipped_records": sum(self.state.skipped.values()),
            "skipped_steps": self.state.skipped_steps,
            "weight_store_loads": loads,  # one per trainer node, however many restarts
            "target_tokens": self.state.target_tokens,
            "eval_loss": eval_loss,
            "device": self.inp.device,
            "dtype": self.inp.dtype,
            # the tier of block kernels that ran (docs/architecture.md, "Two tiers of kernels"):
            # full fine-tuning has no LoRA to stack, only compiled blocks make it fast
            "kernels": resolve_kernels(
                "exact" if self.full else self.cfg.kernels, self.inp.device, self.cfg.compile_blocks
            ),
            "trainers": len(self.trainers),
            "finished": model_card.today(),
            "version": model_card.appliance_version(),
        }
        self._write_card(done)
        self.report.finish()  # the adapter to the trackers, and their runs ended
        self.record("complete", done)
        if self.full:  # the writable homes' files go now (weight_home.py)
            ray.get([s.close.remote() for s in self.stores.values()])

    def _write_card(self, done: dict) -> None:
        """The adapter's README.md (model_card.py). A card is documentation: failing to write
        one is said, and the run still completes."""
        base = model_card.base_model(str(self.cfg.model), self.inp.model_dir)
        try:
            note = model_card.write_adapter_card(
                {"config": self.cfg.to_dict(), **done}, base, str(self.cfg.output)
            )
        except Exception as e:  # noqa: BLE001 - e.g. an s3:// output that refused the write
            note = f"the model card (README.md) was not written: {e}"
        if note:
            self.progress.note(note)

    def check_lease(self) -> None:
        """LeaseLost when the output's S3 lease was taken over: nothing more is written there."""
        check = getattr(self.lease, "check", None)
        if check is not None:
            check()

    def record(self, status: str, extra: dict | None = None) -> None:
        """run.json: the run's identity, resolved config and `status` (with `extra`)."""
        self.check_lease()
        inp = self.inp
        fingerprints = (inp.model_fingerprint, inp.data_fingerprint, inp.eval_data_fingerprint)
        tracking = {"tracking": self.report.ids} if self.report.ids else {}
        write_run_file(self.cfg, status, {**tracking, **(extra or {})}, *fingerprints)

    def stop(self) -> None:
        """End this run's actors (the driver's ray.shutdown does it too; tests share one Ray)."""
        import ray

        if self.full:  # the writable homes' files go with their stores (weight_home.py)
            ray.get([s.close.remote() for s in self.stores.values()])
        for actor in [*self.workers, *self.trainers, *self.stores.values()]:
            ray.kill(actor)
