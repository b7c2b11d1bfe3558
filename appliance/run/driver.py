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
import tempfile
import time
from pathlib import Path

from appliance.actors.tokenize_worker import MAX_DEFAULT_WORKERS
from appliance.actors.trainer import resolve_device, resolve_dtype
from appliance.actors.weight_store import weight_store_bytes
from appliance.adapter import model_card
from appliance.cluster.start import (
    check_shared_output,
    on_node,
    start_ray,
    trainer_slots,
)
from appliance.config import TrainConfig, flag, shown
from appliance.data.chat import load_chat_template
from appliance.data.files import (
    count_documents,
    dataset_notes,
    file_names,
    not_held_out_notes,
    resolve_dataset,
)
from appliance.data.records import Holdout, check_dataset, check_has_targets, check_tokenizer_fits
from appliance.errors import NOT_FOUND, ConfigError, StorageError, cause_chain
from appliance.interrupt import GracefulStop, RunInterrupted, stopped_at_once
from appliance.models import resolve_targets
from appliance.models.hf_checkpoint import (
    SafetensorsCheckpoint,
    read_model_args,
    seq_len_problems,
    tokenizer_path,
)
from appliance.models.layers import ModelArgs
from appliance.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from appliance.run.loop import Run
from appliance.run.output_lock import LOCK_FILE, output_lock
from appliance.run.progress import Progress
from appliance.run.record import (
    IDENTITY_KEYS,
    LEGACY_IDENTITY,
    RUN_FILE,
    _parse_record,
    data_changes,
    data_fingerprint,
    model_fingerprint,
    read_run_file,
    run_identity,
)
from appliance.run.state import Inputs
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    LATEST_MARKER,
    checkpoints_uri,
    is_appliance_checkpoint,
    list_checkpoints,
    temp_dirs,
)
from appliance.storage.hub import resolve_model
from appliance.storage.localize import localize, localize_data, localize_model


def apply_demo(cfg: TrainConfig) -> None:
    """With no --model, make the built-in demo (model, corpus, held-out corpus) in a temp dir and
    point `cfg` at it: the held-out corpus is its --eval-data (unless the user chose a validation
    set), so run.json records it and `appliance eval --adapter` takes it from there. The demo's
    run settings were already applied, as a layer below the user's, by config.build_config."""
    if cfg.model is not None:
        return
    from appliance.run.demo import make_demo

    made = make_demo(tempfile.mkdtemp(prefix="appliance-demo-"), seed=cfg.seed)
    cfg.model, cfg.data = made["model"], made["data"]
    cfg.output = cfg.output or made["output"]
    if cfg.eval_data is None and cfg.eval_split is None:
        cfg.eval_data = made["eval_data"]


def prepare(cfg: TrainConfig) -> Inputs:
    """Embedded Ray's setup: resolve the demo, then check every input in this process."""
    apply_demo(cfg)
    _absolute_paths(cfg)
    return resolve_inputs(cfg)


def _absolute_paths(cfg: TrainConfig) -> None:
    """Local --model/--data/--output as absolute paths: relative ones mean the user's directory
    here, not a Ray worker's (with --cluster, on another node)."""

    def absolute(uri: str) -> str:
        return uri if storage.is_s3(uri) else str(Path(uri).expanduser().resolve())

    assert cfg.model is not None and cfg.data is not None and cfg.output is not None
    cfg.model = resolve_model(cfg.model)  # a hub id: its snapshot in the local HF cache
    cfg.data = resolve_dataset(cfg.data)  # (a dataset's, for --data org/name)
    cfg.model, cfg.data, cfg.output = absolute(cfg.model), absolute(cfg.data), absolute(cfg.output)
    if cfg.eval_data:
        cfg.eval_data = absolute(resolve_dataset(cfg.eval_data, "--eval-data"))
    if cfg.chat_template:
        cfg.chat_template = absolute(cfg.chat_template)


def resolve_inputs(cfg: TrainConfig, where: str | None = None) -> Inputs:
    """Fetch (s3://) and check model, tokenizer, data and output, where this runs: in the driver
    for embedded Ray, on the trainer's node with --cluster (`where` names that node)."""
    assert cfg.model is not None and cfg.data is not None and cfg.output is not None
    if cfg.auto_resume:  # the run --output holds is continued; with none there, one starts
        cfg.resume = read_run_file(cfg.output) is not None
    try:
        model_dir = localize_model(cfg.model)
        data_path = localize_data(cfg.data)
    except StorageError as e:
        recorded = (read_run_file(cfg.output) or {}).get("config", {}) if cfg.resume else {}
        for what, uri in (("model", cfg.model), ("data", cfg.data)):
            if e.uri == uri == recorded.get(what) and e.kind == NOT_FOUND:  # not a new typo
                raise ConfigError(
                    f"--resume: the run's {what} {uri} is not there any more. If it moved, give "
                    f"its new place: appliance train --output {cfg.output} --resume --{what} "
                    f"NEW_PATH (its files are checked against the run's {what})"
                ) from None
        if where is None or storage.is_s3(e.uri or ""):
            raise
        raise ConfigError(
            f"{e.uri} is not visible from the trainer's node {where}: with "
            "--cluster give s3:// URIs or paths shared by every node"
        ) from None
    args = read_model_args(model_dir)  # refuses unsupported architectures before any weight
    # every tensor there, readable, of the shape config.json implies (headers only): before the
    # RAM estimate, which a wrong shape in config.json would make blame the box's RAM; with no
    # weights at all, the RAM a model that big needs is said first
    has_weights = any(Path(model_dir).glob("*.safetensors"))
    if has_weights:
        SafetensorsCheckpoint(model_dir).check(args)
    check_box(cfg, args)  # /dev/shm, RAM: fail in seconds, not with an OOM kill later
    if not has_weights:
        SafetensorsCheckpoint(model_dir).check(args)  # names what is missing
    tok = tokenizer_path(model_dir)
    tokenizer = check_tokenizer_fits(tok, args.vocab_size, model_dir)  # ids past the embedding
    # errors here are clear; inside an actor they'd be wrapped
    files = check_dataset(data_path)
    notes = dataset_notes(data_path, "--data", cfg.data)  # files skipped, several splits
    eval_data = eval_fingerprint = None
    if cfg.eval_data:
        eval_data = localize_data(cfg.eval_data)
        eval_fingerprint = data_fingerprint(eval_data, check_dataset(eval_data))
        notes += dataset_notes(eval_data, "--eval-data", cfg.eval_data)
        notes += not_held_out_notes(data_path, eval_data, cfg.eval_data)
    chat = load_chat_template(model_dir, localize(cfg.chat_template) if cfg.chat_template else None)
    if args.eos_token_id is not None:  # (its absence is reported below)
        holdout = Holdout(cfg.eval_split, cfg.seed) if cfg.eval_split else None
        check_has_targets(data_path, tokenizer, args.eos_token_id, chat, holdout, cfg.on_bad_record)
    problems = seq_len_problems(args, cfg.seq_len)
    try:  # --lora-targets against the model's family (Phi-3's fused modules)
        targets = resolve_targets(args, tuple(cfg.lora_targets))
    except ConfigError as e:
        problems.append(str(e))
    else:
        problems += lora_rank_problems(args, cfg.lora_rank, targets)
    if args.eos_token_id is None:
        problems.append(
            f"{model_dir}/config.json has no eos_token_id, nor does generation_config.json or "
            'the tokenizer (eos_token): packing needs one: add "eos_token_id": ID to config.json'
        )
    if problems:
        raise ConfigError("\n".join(problems))
    device = resolve_device(cfg.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible (use --device cpu or auto)")
    # read once (check_output and run.json use them); an s3:// model's from its local copy
    fingerprint = model_fingerprint(str(model_dir))
    data = data_fingerprint(data_path, files)
    notes += check_output(cfg, fingerprint, data, eval_fingerprint)
    return Inputs(
        cfg,
        model_dir,
        data_path,
        int(args.eos_token_id),
        args.pad_token_id,
        device,
        resolve_dtype(cfg.dtype, device),
        eval_data=eval_data,
        chat_template=chat,
        notes=notes,
        model_fingerprint=fingerprint,
        data_fingerprint=data,
        data_files=file_names(data_path, files),
        documents=count_documents(files, MAX_DEFAULT_WORKERS),  # a default worker count's cap
        eval_data_fingerprint=eval_fingerprint,
    )


# settings a resume may change that change how the steps from there on train (the schedule, the
# optimizer, the numerics): said when they differ from the run's, so no change goes unnoticed
TRAINING_SETTINGS = (
    "lr",
    "warmup_steps",
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


def lora_rank_problems(args: ModelArgs, rank: int, targets: tuple[str, ...]) -> list[str]:
    """--lora-rank larger than a layer it adapts (min of its inputs and outputs): a rank past
    that learns nothing more, and a huge one failed as an allocation traceback in the trainer."""
    from appliance.models import TARGETS
    from appliance.models.hf_checkpoint import block_shapes

    modules = {TARGETS[t] for t in targets}
    smallest: tuple[int, str] | None = None
    for i in range(args.num_layers):
        for name, shape in block_shapes(args, i).items():
            module = name.split(".", 3)[-1].removesuffix(".weight")  # model.layers.i.<module>
            if name.endswith(".weight") and module in modules and len(shape) == 2:
                smallest = min(smallest or (min(shape), name), (min(shape), name))
    if smallest is None or rank <= smallest[0]:
        return []
    size, name = smallest
    return [
        f"--lora-rank {rank} is larger than the layer it adapts: {name} is {size} wide at its "
        f"narrowest, so a rank above {size} adds nothing; give --lora-rank {size} or less"
    ]


def check_box(cfg: TrainConfig, args: ModelArgs) -> None:
    """`appliance doctor`'s blocking checks for this run, before any weight is read."""
    from appliance.engine.blocks import dtype_from_name
    from appliance.plan.doctor import blocking_problems

    device = resolve_device(cfg.device)
    dtype_bytes = dtype_from_name(resolve_dtype(cfg.dtype, device)).itemsize
    problems = blocking_problems(args, device == "cuda", cfg.base_quant, dtype_bytes)
    if problems:
        problems.append(f"(appliance doctor --model {cfg.model} checks the rest of this box)")
        raise ConfigError("\n".join(problems))


def check_output(
    cfg: TrainConfig,
    fingerprint: str | None = None,
    data: dict | None = None,
    eval_data: dict | None = None,
) -> list[str]:
    """Refuse an --output that holds something else, unless --overwrite (or --resume of it);
    returns notes for the user. `fingerprint`: the model's `model_fingerprint` (of its local
    copy), when the caller has it (else read here from cfg.model); `data`: the data's
    `data_fingerprint`, when the caller has it (else the data is known by its path alone);
    `eval_data`: --eval-data's, for a note when the run's validation set changed."""
    out = cfg.output
    if cfg.overwrite:  # remove_previous_run replaces the run there, readable or not
        _check_overwrite(out)
        return []
    previous = read_run_file(out)
    if previous is not None:
        previous["identity"] = {**LEGACY_IDENTITY, **previous.get("identity", {})}
        recorded = previous["identity"].get("micro_batches_per_step")
        if cfg.resume and cfg.micro_batches_per_step == "auto" and recorded is not None:
            cfg.micro_batches_per_step = recorded  # auto was resolved when the run started
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
        resume = f"appliance train --output {out} --resume"
        given = "--auto-resume" if cfg.auto_resume else "--resume"
        notes = (
            _eval_data_notes(cfg, previous, eval_data) + _changed_settings_notes(cfg, previous)
            if cfg.resume and same
            else []
        )
        if cfg.resume and same and not same_model:  # changed where it is, or another one
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
        if cfg.resume and same and not same_data:
            assert data is not None and data_was is not None
            what_changed = f"--data {cfg.data} changed since the run started: " + data_changes(
                data_was, data
            )
            if cfg.allow_data_change:
                return [f"{what_changed}; continuing on it, as --allow-data-change asks", *notes]
            if _nothing_kept(out, previous):  # no cursor to keep: the run starts on it afresh
                return [f"{what_changed}; the run has no checkpoint yet: it starts on it", *notes]
            raise ConfigError(
                f"{given}: {what_changed}. The run's data cursors count documents in its files "
                "as they were: put them back to resume it as it was; or add "
                "--allow-data-change to continue on the data as it is now (a file whose name "
                "sorts after the others' is read after them; other changes shift what the "
                "run reads next); or start another run (another --output, or --overwrite)"
            )
        if cfg.resume:
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
            return notes
        what = "the same run" if same else "a different run"
        status = previous.get("status", "unknown")
        if status == "running":  # the driver holds the output's lock: no process writes it now
            status = "stopped before it finished"
        if _nothing_kept(out, previous):  # the same command again, once its data is fixed
            cfg.overwrite = True  # so `train` clears run.json before the new run writes
            return [
                f"--output {out} held {what} that ended ({status}) before its first "
                "checkpoint: nothing of it to keep, starting this run in its place"
            ]
        raise ConfigError(
            f"--output {out} already holds {what} ({status}); continue it with `{resume}`, "
            "or pass --overwrite to replace it"
        )
    if cfg.resume:
        raise ConfigError(
            f"--resume: {out} holds no run to resume ({RUN_FILE} not found); to start a new run "
            "there, leave out --resume (and give --model and --data)"
        )
    if [f for f in storage.list_files(out) if f != LOCK_FILE]:
        raise ConfigError(
            f"--output {out} is not empty and holds no appliance run ({RUN_FILE} not found); "
            "choose an empty or new directory (--overwrite replaces only an appliance run)"
        )
    return []


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


def previous_run_files(output: str) -> list[tuple[str, bool]]:
    """What --overwrite deletes in `output`, in the order it deletes them: (uri, whether it is a
    directory/prefix). Only what appliance wrote there, where its run.json or its checkpoints'
    manifests show it: with appliance's run.json, its adapter files, the `latest` marker, every
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
    gone += [(storage.join(checkpoints_uri(output), LATEST_MARKER), False)]  # none restored
    gone += [(uri, True) for uri in steps]
    gone += [(str(p), True) for p in temp_dirs(output)]
    if recorded:
        card = storage.join(output, model_card.CARD)
        if model_card.is_ours(card):
            gone += [(card, False)]
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
    _absolute_paths(cfg)  # config.validate refuses the demo with --cluster: paths are given
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
    """`--micro-batches-per-step auto`: 4 on a CPU; on a GPU, measure B and P where a trainer's
    GPU is (a one-off Ray task, whose process then exits with its CUDA context) and take
    plan's M. The number replaces `auto` in the config, so run.json records it."""
    from appliance.config import AUTO

    cfg = inp.cfg
    if cfg.micro_batches_per_step != AUTO:
        return
    from appliance.plan.auto import CPU_AUTO_M, auto_micro_batches, measure_this_gpu
    from appliance.plan.estimate import load_args

    if inp.device != "cuda":
        cfg.micro_batches_per_step = CPU_AUTO_M
        progress.note(f"--micro-batches-per-step auto: {CPU_AUTO_M} (on a CPU)")
        return
    import ray

    from appliance.engine.blocks import dtype_from_name

    measure = ray.remote(num_gpus=1, max_calls=1)(measure_this_gpu)
    measured = ray.get(measure.remote(inp.dtype))  # P in the run's compute dtype
    args, _ = load_args(cfg.model, None)  # config.json (with --cluster: shared path or s3://)
    m, why = auto_micro_batches(
        args,
        measured,
        seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        lora_rank=cfg.lora_rank,
        lora_targets=tuple(cfg.lora_targets),
        dtype_bytes=dtype_from_name(inp.dtype).itemsize,
        budget=cfg.budget_bytes(),
        base_quant=cfg.base_quant,
    )
    cfg.micro_batches_per_step = m
    progress.note(
        f"--micro-batches-per-step auto: {m} ({why}; measured B = "
        f"{measured['h2d_bytes_per_second'] / 1e9:.1f} GB/s, P = "
        f"{measured['flops_per_second'] / 1e12:.0f} TFLOP/s on {measured['name']})"
    )


def _record_stop(run: Run) -> None:
    """run.json says a run stopped at once (a second Ctrl-C, or one before its step loop) was
    interrupted: its last checkpoint is where --resume continues."""
    try:
        run.record("interrupted", {"stopped_at_once": True})
    except BaseException:  # noqa: BLE001 - a third Ctrl-C, or the output failing: it stops
        pass


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
    from appliance.metrics.endpoint import METRICS_REPORT_INTERVAL_MS

    ms = METRICS_REPORT_INTERVAL_MS  # what the embedded Ray is started with
    if cfg.cluster:  # the cluster's own setting, as Ray reads it (its default is 10 s)
        ms = int(os.environ.get("RAY_metrics_report_interval_ms", "10000"))
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
        "packing_efficiency": run.state.target_tokens / max(run.state.row_tokens, 1),
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
            f"try the adapter: appliance eval --adapter {cfg.output} (its run's model, "
            "--seq-len and held-out data come with it)\n"
            f"(the demo's model and corpus are in {root}: delete it when done)"
        )
    return summary
