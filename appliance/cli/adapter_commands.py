"""The commands that use an adapter a run wrote: `eval` (mean next-token loss on a file),
`generate` (answer prompts), `export` (a merged checkpoint); the options they take from the run
(adapter_defaults). Each imports the package that does its work inside its function (start-up
time: see main.py)."""

from __future__ import annotations

import json

import click

from appliance.cli.common import PatternHint, friendly_errors
from appliance.config import (
    CHOICES,
    FIELDS,
    TrainConfig,
    build_config,
    flag,
)
from appliance.errors import ConfigError

_MODEL_HELP = (
    "Base model: a directory, an s3:// prefix, or a Hugging Face id (org/name) that is in the "
    "local Hugging Face cache. Default with --adapter: the model its run trained on (run.json, "
    "or a checkpoint's config.json), else the one its adapter_config.json names."
)
_ADAPTER_HELP = (
    "LoRA adapter directory (PEFT format): a run's --output, one of its checkpoints "
    "(OUTPUT/checkpoints/step-N), or any PEFT adapter; local or s3://."
)


QUIET = ("base_quant", "dtype")  # taken from the run, but said only when not train's default


def adapter_defaults(adapter: str, adapter_dir, given: dict, device: str | None = None) -> dict:
    """`given` with the options left out (None: model, seq_len, chat_template, data, base_quant,
    dtype) filled from the run that wrote the adapter (`adapter`, fetched into `adapter_dir`),
    and a note saying so; a model from its adapter_config.json when it has no run. `data` is the
    run's validation set: its --eval-data, or its --data with `eval_split` and `seed` (the
    documents they held out) added; `dtype` only when the run ran on `device`'s kind (a GPU run's
    bfloat16 is no choice for a CPU). A missing --model, --seq-len or --data with nothing to take
    it from, or a local path taken that is gone, is an error naming the flag."""
    from pathlib import Path

    from appliance.errors import ConfigError
    from appliance.models.lora import ADAPTER_CONFIG
    from appliance.run.record import adapter_run_config
    from appliance.storage import uri as storage
    from appliance.storage.checkpoints import json_object
    from appliance.storage.globs import has_glob, split_glob
    from appliance.storage.hub import is_hub_id

    if adapter_dir.is_file():  # adapter_model.safetensors, say, rather than its directory
        hint = f": did you mean {adapter_dir.parent}?"
        hint = hint if (adapter_dir.parent / ADAPTER_CONFIG).is_file() else ""
        raise ConfigError(f"--adapter must be a directory (the one holding {ADAPTER_CONFIG}){hint}")
    given, found, taken = dict(given), adapter_run_config(adapter_dir), {}
    config, source = found if found else ({}, None)
    if source is not None and storage.is_s3(adapter):  # named as given, not as its local copy
        source = storage.join(adapter, Path(source).relative_to(adapter_dir).as_posix())
    if found is None and given.get("model") is None:  # a PEFT adapter: the model it names
        named = json_object(adapter_dir / ADAPTER_CONFIG) or {}
        base, revision = named.get("base_model_name_or_path"), named.get("revision")
        if isinstance(base, str) and base:
            config = {"model": f"{base}@{revision}" if revision else base}
            source = f"{adapter}/{ADAPTER_CONFIG}"
    split = None if config.get("eval_data") else config.get("eval_split")
    known = {**config, "data": config.get("data") if split else config.get("eval_data")}
    if device is not None and config.get("device", "auto") not in ("auto", device):
        known.pop("dtype", None)  # chosen for another kind of device: this one's auto instead
    for key, value in given.items():
        if value is None and known.get(key) not in (None, []):
            given[key] = taken[key] = known[key]
    if "data" in taken and split:
        given["eval_split"], given["seed"] = split, config.get("seed", TrainConfig.seed)
        taken["data"] += f" (the {split} of it that --seed {given['seed']} held out)"
    no_run = f"{adapter} holds no run record (run.json, or a checkpoint's config.json)"
    for key in ("model", "seq_len", "data"):
        if key not in given or given[key] is not None:
            continue
        if key == "model":
            why = f"{no_run}, nor does its {ADAPTER_CONFIG} name a base model"
        elif key == "data" and found:
            why = f"the run of {adapter} had no validation set (--eval-data or --eval-split)"
            why += " to take it from"
        else:
            why = f"{no_run} to take it from"
        raise ConfigError(f"{flag(key)} needed: {why}")
    for key in ("model", "data"):  # a local path taken from the run, moved since
        value = given[key] if key in taken else None
        if value and not storage.is_s3(value) and not is_hub_id(value):
            if not Path(split_glob(value)[0] if has_glob(value) else value).exists():
                raise ConfigError(
                    f"{flag(key)} {value} (from {source}) is not there any more: if it moved, "
                    f"give its new place with {flag(key)} PATH"
                )
    said = {k: v for k, v in taken.items() if k not in QUIET or v != FIELDS[k].default}
    if said:
        shown = " ".join(f"{flag(k)} {v}" for k, v in said.items())
        click.echo(f"note: {shown} (from {source})", err=True)
    return given


@click.command(
    "eval", cls=PatternHint, short_help="Mean next-token loss of a model (and adapter) on a file."
)
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", default=None, help=_ADAPTER_HELP)
@click.option(
    "--data",
    default=None,
    help="Data as train reads it: .jsonl/.json/.parquet/.arrow/.txt (compressed too), a dir of "
    "them, a glob pattern, s3:// or a cached Hugging Face dataset id (text, prompt + "
    "completion, or conversations); scored on the targets training uses. Default with "
    "--adapter: its run's validation set (--eval-data, or the documents --eval-split held out).",
)
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help="Truncate each record to N tokens (default with --adapter: its run's --seq-len).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where to evaluate: auto takes CUDA when a GPU is visible.",
)
@click.option(
    "--dtype",
    type=click.Choice(CHOICES["dtype"]),
    default=None,
    help="Compute dtype: auto is bfloat16 on GPU (float16 without bf16), float32 on CPU (default: "
    "auto; with --adapter, its run's --dtype).",
)
@click.option(
    "--base-quant",
    type=click.Choice(CHOICES["base_quant"]),
    default=None,
    help="Quantize the base model's linear weights, as `train --base-quant` (default: none; with "
    "--adapter, its run's, so a QLoRA run's adapter is scored as it trained: give none for the "
    "unquantized base).",
)
@click.option(
    "--chat-template",
    default=None,
    help="Chat template for conversation records instead of the model's: a built-in name "
    "(chatml, llama3, gemma, mistral) or a jinja file (default with --adapter: its run's "
    "--chat-template).",
)
@click.option(
    "--on-bad-record",
    type=click.Choice(CHOICES["on_bad_record"]),
    default="fail",
    show_default=True,
    help="A malformed record: stop naming it (fail), or leave it out with a warning (skip).",
)
@click.option("--field-messages", default=None, help=FIELDS["field_messages"].metadata["help"])
@click.option(
    "--message-property-mappings",
    default=None,
    help=FIELDS["message_property_mappings"].metadata["help"],
)
@click.option("--roles", default=None, help=FIELDS["roles"].metadata["help"])
@click.option(
    "--no-base",
    is_flag=True,
    help="With --adapter, score the adapter alone (by default the base model's loss is given "
    "beside it: base_loss, base_perplexity).",
)
@friendly_errors
def eval_cmd(
    model: str | None,
    adapter: str | None,
    data: str | None,
    seq_len: int | None,
    device: str,
    dtype: str | None,
    base_quant: str | None,
    chat_template: str | None = None,
    on_bad_record: str = "fail",
    field_messages: str | None = None,
    message_property_mappings: str | None = None,
    roles: str | None = None,
    no_base: bool = False,
):
    """Print {"loss": mean next-token NLL, "tokens": target tokens, "perplexity"} as one JSON
    line; with --adapter also the base model's "base_loss" and "base_perplexity"."""
    from appliance.actors.trainer import resolve_device, resolve_dtype
    from appliance.adapter.evaluate import check_device, evaluate
    from appliance.data.listing import dataset_notes, resolve_dataset
    from appliance.data.records import Holdout
    from appliance.engine.blocks import dtype_from_name
    from appliance.run.record import other_model_note
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_data, localize_model

    dev = resolve_device(device)
    check_device(dev)  # before resolve_dtype asks the GPU what it computes
    adapter_dir = localize_adapter(adapter) if adapter else None
    holdout = None
    if adapter:
        given = {"model": model, "seq_len": seq_len, "chat_template": chat_template, "data": data,
                 "base_quant": base_quant, "dtype": dtype, "field_messages": field_messages,
                 "message_property_mappings": message_property_mappings,
                 "roles": roles}  # fmt: skip
        filled = adapter_defaults(adapter, adapter_dir, given, device=dev)
        model, seq_len, chat_template, data, base_quant, dtype = (
            filled[k] for k in list(given)[:6]
        )
        field_messages, message_property_mappings, roles = (filled[k] for k in list(given)[6:])
        if "eval_split" in filled:  # the documents the run held out of its --data
            holdout = Holdout(filled["eval_split"], filled["seed"], held_out=True)
    else:
        flags = (("--model", model), ("--data", data), ("--seq-len", seq_len))
        missing = [flag for flag, value in flags if value is None]
        if missing:
            raise click.UsageError(
                f"{' and '.join(missing)} needed (without --adapter there is no run to take "
                f"{'them' if len(missing) > 1 else 'it'} from)"
            )
    base_quant, dtype = base_quant or TrainConfig.base_quant, dtype or TrainConfig.dtype
    shape = {"field_messages": field_messages, "message_property_mappings":
             message_property_mappings, "roles": roles}  # fmt: skip
    fields = build_config(flag_values={k: v for k, v in shape.items() if v}).field_map()
    model_dir = localize_model(resolve_model(model))  # the model's errors before the data's
    if adapter_dir is not None and (note := other_model_note(adapter_dir, model_dir, model)):
        click.echo(f"note: {note}", err=True)
    data_path = localize_data(resolve_dataset(data))
    for note in dataset_notes(data_path, "--data", data):  # files skipped, several splits
        click.echo(f"note: {note}", err=True)
    result = evaluate(
        model_dir,
        data_path,
        seq_len,
        adapter_dir=adapter_dir,
        device=dev,
        dtype=dtype_from_name(resolve_dtype(dtype, dev)),
        base_quant=base_quant,
        chat_template=chat_template,
        on_bad_record=on_bad_record,
        warn=lambda message: click.echo(f"warning: {message}", err=True),
        holdout=holdout,
        fields=fields,
        with_base=adapter_dir is not None and not no_base,
    )
    click.echo(json.dumps(result))


@click.command(short_help="Answer prompts with a model and an adapter (or a merged export).")
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", default=None, help=_ADAPTER_HELP + " None: the model alone.")
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt (repeat for several).")
@click.option("--prompts", "prompts_file", default=None, help="A file of prompts, one a line.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="0: greedy; above 0, sample at this temperature.",
)
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--dtype", type=click.Choice(CHOICES["dtype"]), default=None)
@click.option("--base-quant", type=click.Choice(CHOICES["base_quant"]), default=None)
@click.option(
    "--gpu-memory-budget",
    default=None,
    help="Cap the GPU memory, e.g. 24GiB: blocks (and then the KV caches) beyond it stay in "
    "host memory and stream through the GPU.",
)
@click.option(
    "--chat-template",
    default=None,
    help="Chat template for the prompts: a built-in name (chatml, llama3, gemma, mistral) or a "
    "jinja file (default: the model's; with --adapter, its run's --chat-template).",
)
@click.option(
    "--no-chat-template", is_flag=True, help="Give the prompts as raw text, no chat template."
)
@friendly_errors
def generate(
    model: str | None,
    adapter: str | None,
    prompt_texts: tuple[str, ...],
    prompts_file: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    device: str,
    dtype: str | None,
    base_quant: str | None,
    gpu_memory_budget: str | None,
    chat_template: str | None,
    no_chat_template: bool,
) -> None:
    """Print one JSON line per prompt: {"prompt", "answer", "tokens"}."""
    from pathlib import Path

    from appliance.actors.trainer import resolve_device, resolve_dtype
    from appliance.adapter.evaluate import check_device
    from appliance.adapter.generate import Generator, Sampling
    from appliance.config import parse_bytes
    from appliance.data.chat import ChatError, load_chat_template
    from appliance.engine.blocks import dtype_from_name
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_model

    prompts = list(prompt_texts)
    if prompts_file is not None:
        if not Path(prompts_file).is_file():
            raise ConfigError(f"--prompts {prompts_file}: no such file")
        lines = Path(prompts_file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise click.UsageError("give --prompt TEXT (repeatable) or --prompts FILE")
    problems = [
        f"{name} must be {rule} (got {value})"
        for name, value, ok, rule in (
            ("--max-new-tokens", max_new_tokens, max_new_tokens >= 1, "≥ 1"),
            ("--temperature", temperature, temperature >= 0, "≥ 0"),
            ("--top-p", top_p, 0 < top_p <= 1, "in (0, 1]"),
        )
        if not ok
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    dev = resolve_device(device)
    check_device(dev)
    adapter_dir = localize_adapter(adapter) if adapter else None
    if adapter:
        given = {"model": model, "chat_template": chat_template, "base_quant": base_quant,
                 "dtype": dtype}  # fmt: skip
        filled = adapter_defaults(adapter, adapter_dir, given, device=dev)
        model, chat_template, base_quant, dtype = (filled[k] for k in given)
    elif model is None:
        raise click.UsageError("--model needed (without --adapter there is no run to take it from)")
    try:
        budget = parse_bytes(gpu_memory_budget) if gpu_memory_budget else None
    except ValueError as e:
        raise ConfigError(f"--gpu-memory-budget: {e}") from None
    model_dir = localize_model(resolve_model(model))
    try:
        chat = None if no_chat_template else load_chat_template(model_dir, chat_template)
    except ChatError as e:
        raise ConfigError(str(e)) from None
    gen = Generator(
        model_dir,
        adapter_dir,
        device=dev,
        dtype=dtype_from_name(resolve_dtype(dtype or TrainConfig.dtype, dev)),
        base_quant=base_quant or TrainConfig.base_quant,
        chat=chat,
        gpu_memory_budget=budget,
    )
    try:
        ids = [gen.encode(p) for p in prompts]
        outs = gen.generate(ids, Sampling(max_new_tokens, temperature, top_p, seed))
    finally:
        gen.close()
    for prompt, out in zip(prompts, outs, strict=True):
        answer = gen.decode([t for t in out if t not in gen.stop_ids])
        click.echo(json.dumps({"prompt": prompt, "answer": answer, "tokens": len(out)}))


@click.command()
@click.option("--model", default=None, help=_MODEL_HELP)
@click.option("--adapter", required=True, help=_ADAPTER_HELP)
@click.option(
    "--output",
    required=True,
    help="Directory for the merged checkpoint (new), or an s3:// prefix (empty).",
)
@friendly_errors
def export(model: str | None, adapter: str, output: str) -> None:
    """Write base + adapter merged into a Hugging Face checkpoint."""
    from appliance.adapter.export import export_to
    from appliance.run.record import other_model_note
    from appliance.storage.hub import resolve_model
    from appliance.storage.localize import localize_adapter, localize_model

    adapter_dir = localize_adapter(adapter)
    model = adapter_defaults(adapter, adapter_dir, {"model": model})["model"]
    model = resolve_model(model)  # a hub id: its snapshot, which the model card names by the id
    model_dir = localize_model(model)
    if note := other_model_note(adapter_dir, model_dir, model):
        click.echo(f"note: {note}", err=True)
    export_to(model_dir, adapter_dir, output, shown_as=(model, adapter))
    click.echo(f"merged checkpoint written to {output}")
