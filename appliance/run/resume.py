"""What --output holds, and what that decides for a run: start in an empty place, resume the run
recorded there (its identity, model and data checked against this command's), or replace it
(--overwrite removes only what appliance wrote). `decide_output` returns the decision; the
driver applies it once, to a copy of the config.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

from appliance.actors.full_trainer import written_files
from appliance.adapter import model_card
from appliance.config import TrainConfig, flag, shown
from appliance.errors import ConfigError, appliance_command
from appliance.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from appliance.run.history_log import HISTORY_FILE
from appliance.run.record import (
    IDENTITY_KEYS,
    LEGACY_IDENTITY,
    RUN_FILE,
    _parse_record,
    data_changes,
    model_fingerprint,
    read_run_file,
    run_identity,
)
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    LATEST_MARKER,
    checkpoints_uri,
    is_appliance_checkpoint,
    list_checkpoints,
    temp_dirs,
)
from appliance.storage.history import history_uri
from appliance.storage.output_lock import LOCK_FILE


@dataclass(frozen=True)
class OutputDecision:
    """What --output decides for a run (decide_output). The config the user gave is not changed:
    `applied_to` makes the run's config from it."""

    resume: bool = False  # continue the run recorded there (--resume, or --auto-resume found one)
    replace: bool = False  # remove the previous run first (--overwrite, or one that kept nothing)
    micro_batches_per_step: int | None = None  # the run's own, for `auto` when resuming
    notes: tuple[str, ...] = ()  # for the user

    def applied_to(self, cfg: TrainConfig) -> TrainConfig:
        """The run's config: a copy of `cfg` with this decision's resume, replace and M."""
        m = self.micro_batches_per_step or cfg.micro_batches_per_step
        run = replace(cfg, resume=self.resume, overwrite=self.replace, micro_batches_per_step=m)
        run.given = cfg.given  # (not a field: replace leaves it out)
        return run


# settings a resume may change that change how the steps from there on train (the schedule, the
# optimizer, the numerics): said when they differ from the run's, so no change goes unnoticed
TRAINING_SETTINGS = (
    "lr",
    "warmup_steps",
    "warmup_ratio",
    "min_lr_ratio",
    "weight_decay",
    "grad_clip",
    "lora_dropout",
    "dtype",
    "on_bad_record",
)


def _changed_settings_notes(cfg: TrainConfig, previous: dict) -> list[str]:
    """A note naming the training settings given now that differ from the run's (run.json's
    config): the steps from here on use them, and run.json and the model card say so."""
    was = previous.get("config", {})
    changed = [
        f"{flag(k)} {shown(getattr(cfg, k))} (the run's: {shown(was[k])})"
        for k in TRAINING_SETTINGS
        if k in was and was[k] != getattr(cfg, k) and not (k == "dtype" and cfg.dtype == "auto")
    ]
    if not changed:
        return []
    return [
        f"--resume with {'; '.join(changed)}: the steps from here on train with "
        f"{'these' if len(changed) > 1 else 'it'}, and the run's record and model card say so"
    ]


def _eval_data_notes(cfg: TrainConfig, previous: dict, now: dict | None) -> list[str]:
    """A note when the run's --eval-data (the same path) holds other files than when it started:
    the validation set may change (it is not what the run trains on), but its losses then
    compare with the earlier ones no more."""
    was = previous.get("eval_data_fingerprint")  # none in a run.json from before them
    same_path = previous.get("config", {}).get("eval_data") == cfg.eval_data
    if not (was and now and same_path) or was["digest"] == now["digest"]:
        return []
    return [
        f"--eval-data {cfg.eval_data} changed since the run started: {data_changes(was, now)}; "
        "validation losses from here on are on the files as they are now, not comparable with "
        "the run's earlier ones"
    ]


def _nothing_kept(out: str, previous: dict) -> bool:
    """Did the run recorded in `out` (its run.json `previous`) end before its first checkpoint,
    leaving nothing a new run in its place would lose? Not a complete run. (One recorded as
    running is not running: this driver holds the output's lock.)"""
    if previous.get("status") == "complete":
        return False
    return not list_checkpoints(out) and not storage.exists(storage.join(out, ADAPTER_CONFIG))


def decide_output(
    cfg: TrainConfig,
    fingerprint: str | None = None,
    data: dict | None = None,
    eval_data: dict | None = None,
) -> OutputDecision:
    """What --output decides for this run: refuse one that holds something else, unless
    --overwrite (or --resume of it); resume the run there (--resume, --auto-resume), replace it,
    or start in an empty place. `cfg` is read, never changed. `fingerprint`: the model's `model_fingerprint` (of its local
    copy), when the caller has it (else read here from cfg.model); `data`: the data's
    `data_fingerprint`, when the caller has it (else the data is known by its path alone);
    `eval_data`: --eval-data's, for a note when the run's validation set changed."""
    out = cfg.output
    if cfg.overwrite:  # remove_previous_run replaces the run there, readable or not
        _check_overwrite(out)
        return OutputDecision(replace=True)
    previous = read_run_file(out)
    # --auto-resume: the run --output holds is continued; with none there, one starts
    resuming = cfg.resume or (cfg.auto_resume and previous is not None)
    if previous is not None:
        previous["identity"] = {**LEGACY_IDENTITY, **previous.get("identity", {})}
        recorded = previous["identity"].get("micro_batches_per_step")
        m = None  # the run's own M, where --micro-batches-per-step auto resumes it
        if resuming and cfg.micro_batches_per_step == "auto" and recorded is not None:
            m = recorded  # auto was resolved when the run started
            cfg = replace(cfg, micro_batches_per_step=m)  # (a copy, to compare identities)

        def resumed(notes: list[str]) -> OutputDecision:
            return OutputDecision(resume=True, micro_batches_per_step=m, notes=tuple(notes))

        was, now = previous["identity"], run_identity(cfg)
        model_now, model_was = (
            fingerprint or model_fingerprint(cfg.model),
            previous.get("model_fingerprint"),
        )  # none in a run.json from before them: the model is known by its path alone
        same_model = model_now is None or model_was is None or model_now == model_was
        moved = was.get("model") != now["model"]
        if moved and (_the_runs_model_moved_to(model_now, previous) or cfg.allow_model_change):
            was = {**was, "model": now["model"]}  # run.json records the new path from now on
        data_was = previous.get("data_fingerprint")  # none in a run.json from before them
        same_data = data is None or data_was is None or data["digest"] == data_was["digest"]
        if was.get("data") != now["data"] and data is not None and data_was and same_data:
            was = {**was, "data": now["data"]}  # the run's data, moved: followed like the model
        same = was == now
        resume = f"{appliance_command()} train --output {out} --resume"
        given = "--auto-resume" if cfg.auto_resume else "--resume"
        notes = (
            _eval_data_notes(cfg, previous, eval_data) + _changed_settings_notes(cfg, previous)
            if resuming and same
            else []
        )
        if resuming and same and not same_model:  # changed where it is, or another one
            what_changed = (
                f"--model {cfg.model} changed since the run started: its files (config.json, "
                "tokenizer or weights) differ from the run's record of them"
                if not moved
                else f"--model {cfg.model} is not the run's model ({previous['identity']['model']})"
            )
            if cfg.allow_model_change:
                notes = [f"{what_changed}; continuing on it, as --allow-model-change asks", *notes]
            elif not _nothing_kept(out, previous):
                raise ConfigError(
                    f"{given}: {what_changed}, so its adapter would go on learning against other "
                    "weights than it began on. Put the model back as it was to resume the run; "
                    "or add --allow-model-change to continue on the model as it is now; or "
                    "start another run (another --output, or --overwrite)"
                )
        if resuming and same and not same_data:
            assert data is not None and data_was is not None
            what_changed = f"--data {cfg.data} changed since the run started: " + data_changes(
                data_was, data
            )
            if cfg.allow_data_change:
                return resumed(
                    [f"{what_changed}; continuing on it, as --allow-data-change asks", *notes]
                )
            if _nothing_kept(out, previous):  # no cursor to keep: the run starts on it afresh
                return resumed(
                    [f"{what_changed}; the run has no checkpoint yet: it starts on it", *notes]
                )
            raise ConfigError(
                f"{given}: {what_changed}. The run's data cursors count documents in its files "
                "as they were: put them back to resume it as it was; or add "
                "--allow-data-change to continue on the data as it is now (a file whose name "
                "sorts after the others' is read after them; other changes shift what the "
                "run reads next); or start another run (another --output, or --overwrite)"
            )
        if resuming:
            if not same:
                changed = [
                    f"{flag(k)} {shown(now[k])} (the run: {shown(was.get(k))})"
                    for k in IDENTITY_KEYS
                    if was.get(k) != now[k]
                ]
                also = (
                    "; to start another run, give another --output (or --overwrite this one)"
                    if cfg.auto_resume
                    else ""
                )
                raise ConfigError(
                    f"{given}: {out} holds a run with different {'; '.join(changed)}: resuming "
                    f"would break it. To continue that run as it was: {resume}{also}"
                )
            return resumed(notes)
        what = "the same run" if same else "a different run"
        status = previous.get("status", "unknown")
        if status == "running":  # the driver holds the output's lock: no process writes it now
            status = "stopped before it finished"
        if _nothing_kept(out, previous):  # the same command again, once its data is fixed
            return OutputDecision(  # `train` clears run.json before the new run writes
                replace=True,
                notes=(
                    f"--output {out} held {what} that ended ({status}) before its first "
                    "checkpoint: nothing of it to keep, starting this run in its place",
                ),
            )
        raise ConfigError(
            f"--output {out} already holds {what} ({status}); continue it with `{resume}`, "
            "or pass --overwrite to replace it"
        )
    if resuming:
        raise ConfigError(
            f"--resume: {out} holds no run to resume ({RUN_FILE} not found); to start a new run "
            "there, leave out --resume (and give --model and --data)"
        )
    if [f for f in storage.list_files(out) if f != LOCK_FILE]:
        raise ConfigError(
            f"--output {out} is not empty and holds no appliance run ({RUN_FILE} not found); "
            "choose an empty or new directory (--overwrite replaces only an appliance run)"
        )
    return OutputDecision()


def _recorded_run(output: str) -> bool:
    """Whether `output` holds an appliance run's record: a run.json that is appliance's (its
    identity or config), or one torn beyond reading (appliance's writes are what tear it; the
    error that names it offers --overwrite)."""
    run_file = storage.join(output, RUN_FILE)
    if storage.is_s3(run_file):
        if not storage.exists(run_file):
            return False
    elif not storage.to_local(run_file).is_file():
        return False
    record, _ = _parse_record(storage.read_bytes(run_file))
    return record is None or "identity" in record or "config" in record


def _recorded_full(output: str) -> bool:
    """Whether `output`'s run.json records a full fine-tune (--finetuning-type full)."""
    record, _ = _parse_record(storage.read_bytes(storage.join(output, RUN_FILE)))
    config = (record or {}).get("config") or {}
    return isinstance(config, dict) and config.get("finetuning_type") == "full"


def previous_run_files(output: str) -> list[tuple[str, bool]]:
    """What --overwrite deletes in `output`, in the order it deletes them: (uri, whether it is a
    directory/prefix). Only what appliance wrote there, where its run.json or its checkpoints'
    manifests show it: with appliance's run.json, its adapter files (a full fine-tune's model
    files: full_trainer.written_files), the `latest` marker, every
    `checkpoints/step-N` directory and the temp dirs of an interrupted save, its model card
    (when the card says appliance wrote it) and run.json itself; without one, only the
    checkpoints whose manifest appliance wrote (and `latest`). Anything else (another tool's
    checkpoints, `checkpoints/epoch-3`, notes, data) is the user's and stays."""
    recorded = _recorded_run(output)
    steps = [i.uri for i in list_checkpoints(output) if recorded or is_appliance_checkpoint(i.uri)]
    if not recorded and not steps:
        return []
    gone: list[tuple[str, bool]] = []
    if recorded:  # adapter_config.json first: no moment shows a complete-looking adapter
        gone += [(storage.join(output, ADAPTER_CONFIG), False)]
        gone += [(storage.join(output, ADAPTER_WEIGHTS), False)]
    if recorded and _recorded_full(output):  # a full fine-tune's model, config.json first
        gone += [
            (storage.join(output, n), False) for n in written_files(storage.list_files(output))
        ]
    gone += [(storage.join(checkpoints_uri(output), LATEST_MARKER), False)]  # none restored
    gone += [(uri, True) for uri in steps]
    gone += [(str(p), True) for p in temp_dirs(output)]
    gone += [(history_uri(checkpoints_uri(output)), True)]  # the checkpoints' loss history
    if recorded:
        card = storage.join(output, model_card.CARD)
        if model_card.is_ours(card):
            gone += [(card, False)]
        gone += [(storage.join(output, HISTORY_FILE), False)]
        gone += [(storage.join(output, RUN_FILE), False)]
    return gone


def _check_overwrite(out: str) -> None:
    """--overwrite replaces an appliance run, and only that: an --output that holds none (no
    run.json of appliance's, no checkpoint of appliance's) but other files is refused, nothing
    deleted; so is one whose adapter files no run.json accounts for (the new run would write
    over them)."""
    recorded = _recorded_run(out)
    if recorded:
        return
    files = [f for f in storage.list_files(out) if f != LOCK_FILE]
    if not files:
        return
    ours = bool(previous_run_files(out))
    adapter = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if f in files]
    if ours and not adapter:
        return
    what = (
        f"its {' and '.join(adapter)} are not recorded by an appliance {RUN_FILE}"
        if ours
        else f"it holds no appliance run ({RUN_FILE} not found, no appliance checkpoint)"
    )
    raise ConfigError(
        f"--overwrite: --output {out} {what}, and --overwrite removes only what appliance wrote; "
        "choose an empty or new --output (or move those files out)"
    )


def _the_runs_model_moved_to(fingerprint: str | None, previous: dict) -> bool:
    """Whether the model given now (its `fingerprint`) is the run's own model at a new path: the
    same files (config, tokenizer, safetensors headers, samples of the weights) as run.json's
    fingerprint of it. A run.json written before fingerprints has none: its model is known by
    its path alone."""
    recorded = previous.get("model_fingerprint")
    return recorded is not None and fingerprint == recorded


def recorded_config(output: str) -> dict | None:
    """The resolved config in `output`/run.json (what `--output O --resume` continues), or None
    when there is no run.json."""
    record = read_run_file(output)
    config = None if record is None else record.get("config")
    return None if config is None else {**LEGACY_IDENTITY, **config}


def remove_previous_run(output: str) -> None:
    """--overwrite: delete what a previous run left in `output` (local or s3://), as
    `previous_run_files` lists it: its adapter (adapter_config.json first, so no moment shows a
    complete-looking adapter), its checkpoints (the `latest` marker first, so none is ever
    restored into the new run), its model card when appliance wrote it, then run.json. Other
    files are the user's and stay; so does a checkpoints/ directory that still holds them."""
    for uri, is_dir in previous_run_files(output):
        (storage.delete_prefix if is_dir else storage.delete)(uri)
    checkpoints = checkpoints_uri(output)
    if not storage.is_s3(checkpoints):
        with contextlib.suppress(OSError):  # not there, or the user's files are in it
            storage.to_local(checkpoints).rmdir()
