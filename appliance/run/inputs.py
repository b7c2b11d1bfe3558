"""Every input of `appliance train` checked before anything heavy starts: the demo's files, the
model (config.json, safetensors headers, tokenizer), the data, the box (/dev/shm, RAM), LoRA's
targets and rank, the device, and what --output decides (run/resume.py). `resolve_inputs` runs
in the driver with embedded Ray, on a trainer's node with --cluster.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from appliance.actors.tokenize_worker import MAX_DEFAULT_WORKERS
from appliance.actors.trainer import resolve_device, resolve_dtype
from appliance.config import TrainConfig
from appliance.data.chat import load_chat_template
from appliance.data.files import count_documents
from appliance.data.listing import dataset_notes, file_names, not_held_out_notes, resolve_dataset
from appliance.data.records import Holdout, check_dataset, check_has_targets, check_tokenizer_fits
from appliance.data.templates import is_template_name
from appliance.engine.blocks import dtype_from_name
from appliance.engine.full import family_problem
from appliance.errors import NOT_FOUND, ConfigError, StorageError, appliance_command
from appliance.hardware.host import ram_available_bytes
from appliance.models import TARGETS, compile_blocks_note, resolve_targets
from appliance.models.hf_checkpoint import (
    SafetensorsCheckpoint,
    block_shapes,
    read_model_args,
    seq_len_problems,
    skipped_notes,
    tokenizer_path,
)
from appliance.models.layers import ModelArgs
from appliance.plan import full
from appliance.plan.doctor import blocking_problems
from appliance.run.demo import make_demo
from appliance.run.record import (
    data_fingerprint,
    model_fingerprint,
    read_run_file,
)
from appliance.run.resume import decide_output
from appliance.run.state import Inputs
from appliance.storage import uri as storage
from appliance.storage.hub import resolve_model
from appliance.storage.localize import localize, localize_data, localize_model


def apply_demo(cfg: TrainConfig) -> None:
    """With no --model, make the built-in demo (model, corpus, held-out corpus) in a temp dir and
    point `cfg` at it: the held-out corpus is its --eval-data (unless the user chose a validation
    set), so run.json records it and `appliance eval --adapter` takes it from there. The demo's
    run settings were already applied, as a layer below the user's, by config.build_config."""
    if cfg.model is not None:
        return

    made = make_demo(tempfile.mkdtemp(prefix="appliance-demo-"), seed=cfg.seed)
    cfg.model, cfg.data = made["model"], made["data"]
    cfg.output = cfg.output or made["output"]
    if cfg.eval_data is None and cfg.eval_split is None:
        cfg.eval_data = made["eval_data"]


def prepare(cfg: TrainConfig) -> Inputs:
    """Embedded Ray's setup: resolve the demo, then check every input in this process."""
    apply_demo(cfg)
    absolute_paths(cfg)
    return resolve_inputs(cfg)


def absolute_paths(cfg: TrainConfig) -> None:
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
    cfg.mix_data = tuple(
        f"{absolute(resolve_dataset(path, '--mix-data'))}={weight:g}"
        for path, weight in cfg.mixture()
    )
    if cfg.chat_template and not is_template_name(cfg.chat_template):  # a file, not chatml
        cfg.chat_template = absolute(cfg.chat_template)


def resolve_inputs(cfg: TrainConfig, where: str | None = None) -> Inputs:
    """Fetch (s3://) and check model, tokenizer, data and output, where this runs: in the driver
    for embedded Ray, on the trainer's node with --cluster (`where` names that node)."""
    assert cfg.model is not None and cfg.data is not None and cfg.output is not None
    try:
        model_dir = localize_model(cfg.model)
        data_path = localize_data(cfg.data)
    except StorageError as e:
        resuming = cfg.resume or cfg.auto_resume
        recorded = (read_run_file(cfg.output) or {}).get("config", {}) if resuming else {}
        for what, uri in (("model", cfg.model), ("data", cfg.data)):
            if e.uri == uri == recorded.get(what) and e.kind == NOT_FOUND:  # not a new typo
                raise ConfigError(
                    f"--resume: the run's {what} {uri} is not there any more. If it moved, give "
                    f"its new place: {appliance_command()} train --output {cfg.output} --resume --{what} "
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
    model_notes = []
    if has_weights:
        SafetensorsCheckpoint(model_dir).check(args)
        # what the text model leaves out: a vision tower, Qwen3.5's multi-token prediction
        model_notes = skipped_notes(SafetensorsCheckpoint(model_dir), args)
    if cfg.compile_blocks and (note := compile_blocks_note(args)):
        model_notes.append(note)
    check_box(cfg, args)  # /dev/shm, RAM: fail in seconds, not with an OOM kill later
    if not has_weights:
        SafetensorsCheckpoint(model_dir).check(args)  # names what is missing
    tok = tokenizer_path(model_dir)
    tokenizer = check_tokenizer_fits(tok, args.vocab_size, model_dir)  # ids past the embedding
    # errors here are clear; inside an actor they'd be wrapped
    files = check_dataset(data_path)
    notes = model_notes + dataset_notes(data_path, "--data", cfg.data)  # files skipped, splits
    mix_files, mix_fingerprints = [], []  # --mix-data's datasets: listed once, as --data's
    for uri, _ in cfg.mixture():
        path = localize_data(uri)
        found = check_dataset(path)
        notes += dataset_notes(path, "--mix-data", uri)
        mix_files.append(file_names(path, found))
        mix_fingerprints.append(data_fingerprint(path, found))
    eval_data = eval_fingerprint = None
    if cfg.eval_data:
        eval_data = localize_data(cfg.eval_data)
        eval_fingerprint = data_fingerprint(eval_data, check_dataset(eval_data))
        notes += dataset_notes(eval_data, "--eval-data", cfg.eval_data)
        notes += not_held_out_notes(data_path, eval_data, cfg.eval_data)
    template = cfg.chat_template
    if template and not is_template_name(template):  # a file: fetched from s3:// if there
        template = str(localize(template))
    chat = load_chat_template(model_dir, template)
    if args.eos_token_id is not None:  # (its absence is reported below)
        holdout = Holdout(cfg.eval_split, cfg.seed) if cfg.eval_split else None
        check_has_targets(
            data_path,
            tokenizer,
            args.eos_token_id,
            chat,
            holdout,
            cfg.on_bad_record,
            fields=cfg.field_map(),
        )
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
    # read once (decide_output and run.json use them); an s3:// model's from its local copy
    fingerprint = model_fingerprint(str(model_dir))
    data = data_fingerprint(data_path, files)
    if mix_fingerprints:  # the mixture is the run's data: any of its files changed changes it
        data = mixture_fingerprint(data, mix_fingerprints)
    decision = decide_output(cfg, fingerprint, data, eval_fingerprint)
    cfg = decision.applied_to(cfg)  # the run's config (the caller's is left as it was)
    notes += decision.notes
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
        mix_files=mix_files,
    )


def mixture_fingerprint(data: dict, mixed: list[dict]) -> dict:
    """--data's fingerprint with --mix-data's folded into its digest (and kept beside it): a
    resume compares the digest, so a changed file of any dataset of the mixture is seen."""
    import hashlib

    digest = hashlib.sha256("\0".join([data["digest"], *(m["digest"] for m in mixed)]).encode())
    return {**data, "digest": digest.hexdigest(), "mix": mixed}


def lora_rank_problems(args: ModelArgs, rank: int, targets: tuple[str, ...]) -> list[str]:
    """--lora-rank larger than a layer it adapts (min of its inputs and outputs): a rank past
    that learns nothing more, and a huge one failed as an allocation traceback in the trainer."""

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

    device = resolve_device(cfg.device)
    dtype_bytes = dtype_from_name(resolve_dtype(cfg.dtype, device)).itemsize
    problems = blocking_problems(args, device == "cuda", cfg.base_quant, dtype_bytes)
    if cfg.finetuning_type == "full":  # masters, moments and gradients on the host: 18 B/param
        trainers = cfg.trainers or 1
        problem = full.host_problem(
            args, dtype_bytes, ram_available_bytes(), cfg.freeze_embeddings, trainers
        )
        problems += [problem] if problem else []
        problems += [problem] if (problem := family_problem(args)) else []
    if problems:
        problems.append(
            f"({appliance_command()} doctor --model {cfg.model} checks the rest of this box)"
        )
        raise ConfigError("\n".join(problems))
