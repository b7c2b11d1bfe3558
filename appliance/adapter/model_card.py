"""Model cards: the README.md of a trained adapter and of a merged export.

A card is what the Hugging Face Hub shows for a model and what a reader looks for first: which
base model, how to load it, and how it was trained. Its front matter is the Hub's metadata
(huggingface_hub's `ModelCardData`): `base_model` (a Hub id, when the base model came from the
local Hugging Face cache), `library_name` (`peft` for an adapter, `transformers` for a merged
model), and the base card's licence and language, which apply to what is derived from it. The
training table comes from the run's `run.json`: the facts of the finished run, not a template to
fill in. Data is named by its file name or Hub id only, never by the directory it was read from.

`appliance train` writes the adapter's card into --output when the run completes (and rewrites it
when a resumed run completes), unless a README.md there is not one of its own: a card carries a
marker line, and a file without it is the user's and is never overwritten. `appliance export`
writes the merged model's card in place of the base model's README.md (which describes another
model).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.models.lora import ADAPTER_CONFIG
from appliance.models.multimodal import ARCHITECTURES
from appliance.storage import uri as storage
from appliance.storage.checkpoints import CONFIG_FILE, DRIVER_STATE, MANIFEST, RUN_FILE, json_object
from appliance.storage.hub import cached_repo

CARD = "README.md"
#: first line after the front matter of an adapter's card: train rewrites only cards holding it
MARKER = (
    "<!-- written by appliance; a later `appliance train` into this directory rewrites it: "
    "delete this line to keep your edits -->"
)
# what the base model's card says that holds for a model derived from it
CARRIED = ("license", "license_name", "license_link", "language", "pipeline_tag")


@dataclass(frozen=True)
class BaseModel:
    """The base model as a card names it."""

    name: str  # the Hub id, or the path or URI the run was given
    repo_id: str | None = None  # a Hugging Face id (base_model metadata), when known
    revision: str | None = None  # the cached snapshot's commit
    metadata: dict[str, Any] = field(default_factory=dict)  # CARRIED keys of its card
    loader: str = "AutoModelForCausalLM"  # the transformers class (an image-text model's own)

    def shown(self) -> str:
        return f"`{self.name}`" + (f" at {self.revision[:12]}" if self.revision else "")


def base_model(model: str, files: str | Path | None = None) -> BaseModel:
    """`model` as given (or resolved to its snapshot in the Hugging Face cache); `files`: a local
    directory holding its files, for its card's metadata (default: `model` itself)."""

    repo = cached_repo(model)
    repo_id, revision = (repo.repo_id, repo.revision) if repo else (None, None)
    files = Path(files if files is not None else model)
    try:
        arch = json.loads((files / "config.json").read_text())["architectures"][0]
    except Exception:  # noqa: BLE001 - not readable from here (a --cluster node's path): a text model
        arch = None
    return BaseModel(
        name=repo_id or model,
        repo_id=repo_id,
        revision=revision,
        metadata=_carried_metadata(files / CARD),
        loader=arch if arch in ARCHITECTURES else BaseModel.loader,
    )


def _carried_metadata(card: Path) -> dict[str, Any]:
    """The CARRIED keys of the front matter of the base model's card; {} when it has none or it
    cannot be read (a card is documentation: it never stops a run)."""
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(card) or {}
    except Exception:  # noqa: BLE001 - no card, unreadable, or front matter that is not YAML
        return {}
    return {k: meta[k] for k in CARRIED if k in meta} if isinstance(meta, dict) else {}


def is_ours(uri: str) -> bool | None:
    """Whether the README.md at `uri` is a card appliance wrote (its marker line); None when
    there is no file there."""
    if not storage.exists(uri):
        return None
    return MARKER in storage.read_bytes(uri).decode(errors="replace")


def _front_matter(base: BaseModel, marker: bool, **data: Any) -> str:
    """The card's metadata block, then `MARKER` when `marker` (a card train may rewrite)."""
    from huggingface_hub import ModelCardData

    task = "text-generation" if base.loader == BaseModel.loader else "image-text-to-text"
    meta = {"pipeline_tag": task, **base.metadata, **data}
    if base.repo_id:
        meta["base_model"] = base.repo_id
    return f"---\n{ModelCardData(**meta).to_yaml()}\n---\n" + (f"{MARKER}\n" if marker else "")


def _data_name(data: str) -> str:
    """A dataset by its Hub id (from a cached snapshot) or its last path component."""
    repo = cached_repo(data, repo_type="dataset")
    if repo:
        return repo.repo_id + (f"/{repo.inside}" if repo.inside else "")
    return data.rstrip("/").rsplit("/", 1)[-1]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _lora_row(adapter_config: dict[str, Any]) -> tuple[str, str]:
    """The adapter's settings as its adapter_config.json gives them (the modules a pattern on
    image-text models)."""
    targets = adapter_config.get("target_modules")
    targets = ", ".join(targets) if isinstance(targets, list) else f"`{targets}`"
    r, alpha, dropout = (
        _fmt(v) if isinstance(v, int | float) else "?"
        for v in (adapter_config.get(k) for k in ("r", "lora_alpha", "lora_dropout"))
    )
    return "LoRA", f"r {r}, alpha {alpha}, dropout {dropout}, on {targets}"


#: the tier of block kernels a run used (run.json "kernels"), as the card says it
_KERNELS = {
    "exact": ", exact kernels (bitwise transformers + PEFT)",
    "fast": ", fast kernels (within 3x exact's bf16 error of an fp64 reference)",
}


def training_rows(
    record: dict[str, Any], base: BaseModel, adapter_config: dict[str, Any]
) -> list[tuple[str, str]]:
    """The training table of a completed run, from its run.json `record` and the
    adapter_config.json of the adapter it wrote."""
    c, steps = record["config"], record.get("steps", 0)
    quant = c.get("base_quant", "none")
    quantized = (
        "" if quant == "none" else f"; base weights {quant}-quantized while training (QLoRA)"
    )
    rows = [("base model", base.shown() + quantized)]
    packing = {"documents": "packed by documents", "stream": "packed as one stream"}
    data = f"`{_data_name(str(c.get('data') or ''))}`"
    rows.append(("data", f"{data}, {packing.get(c.get('packing'), c.get('packing'))}"))
    trainers = record.get("trainers", 1)
    shape = (
        f"{c['micro_batches_per_step']} micro-batches of {c['micro_batch_size']} × "
        f"{c['seq_len']} tokens per step"
        + (f" on each of {trainers} trainers" if trainers > 1 else "")
    )
    tokens = record.get("target_tokens")
    trained = f"{steps} ({shape}" + (f"; {tokens:,} tokens trained on)" if tokens else ")")
    rows.append(("steps", trained))
    if c.get("finetuning_type") == "full":
        frozen = " but the input embeddings (frozen)" if c.get("freeze_embeddings") else ""
        rows.append(("fine-tuning", f"full: every weight{frozen} trained, fp32 AdamW on the host"))
    else:
        rows.append(_lora_row(adapter_config))
    schedule = (
        f"AdamW, lr {_fmt(c['lr'])}, {c['warmup_steps']} warm-up steps then cosine decay to "
        f"{_fmt(c['min_lr_ratio'])}× lr, weight decay {_fmt(c['weight_decay'])}, gradient clip "
        f"{_fmt(c['grad_clip'])}"
    )
    rows.append(("optimizer", schedule))
    if record.get("dtype"):
        tier = _KERNELS.get(record.get("kernels"), "")  # absent before the tiers existed
        rows.append(("precision", f"{record['dtype']} on {record.get('device', '?')}{tier}"))
    rows.append(("seed", str(c["seed"])))
    losses = record.get("losses") or []
    if losses:
        rows.append(("training loss", f"{_fmt(losses[0])} at step 1, {_fmt(losses[-1])} at step "
                     f"{len(losses)}"))  # fmt: skip
    if record.get("eval_loss") is not None:
        held = (
            f"`{_data_name(str(c['eval_data']))}`"
            if c.get("eval_data")
            else f"{_fmt(100 * c['eval_split'])}% of the documents, held out"
            if c.get("eval_split")
            else "the demo's held-out set"
        )
        rows.append(("held-out loss", f"{_fmt(record['eval_loss'])} on {held}"))
    if record.get("finished"):
        rows.append(("trained", f"{record['finished']} with appliance {record.get('version', '')}"))
    return rows


def _table(rows: list[tuple[str, str]]) -> str:
    """A Markdown table; a `|` in a cell (an image-text model's target pattern) is escaped, in a
    code span too, as GitHub-flavoured Markdown wants it."""
    escaped = [(k, v.replace("|", "\\|")) for k, v in rows]
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in escaped)


def adapter_card(
    record: dict[str, Any], base: BaseModel, adapter: str, adapter_config: dict[str, Any]
) -> str:
    """The card of the adapter a completed run (run.json `record`) wrote into `adapter`, whose
    adapter_config.json is `adapter_config`."""
    tags = ["lora", "appliance"] + ([f"base_model:adapter:{base.repo_id}"] if base.repo_id else [])
    name = adapter.rstrip("/").rsplit("/", 1)[-1] or adapter
    return (
        _front_matter(base, True, library_name="peft", tags=tags)
        + f"\n# {name}\n\nA LoRA adapter (PEFT format) for `{base.name}`, trained with "
        "appliance.\n\n## Use\n\n```python\nfrom peft import PeftModel\n"
        f"from transformers import {base.loader}\n\n"
        f'model = {base.loader}.from_pretrained("{base.name}")\n'
        f'model = PeftModel.from_pretrained(model, "{adapter}")\n```\n\n'
        "Or merged into the base model's weights, a checkpoint that loads without peft:\n\n"
        f"```sh\nappliance export --model {base.name} --adapter {adapter} --output merged\n```\n\n"
        f"## Training\n\n{_table(training_rows(record, base, adapter_config))}"
    )


def merged_card(
    base: BaseModel,
    adapter: str,
    adapter_config: dict[str, Any],
    record: dict[str, Any] | None,
    output: str,
) -> str:
    """The card of `appliance export`'s merged model in `output`: `base` with `adapter` merged
    in. The training table is the run's when `record` (the adapter's run.json, completed) is
    given, and the adapter's LoRA settings otherwise."""
    lora = [("base model", base.shown()), _lora_row(adapter_config)]
    rows = training_rows(record, base, adapter_config) if record else lora
    return (
        _front_matter(  # no marker: export never writes into a directory that holds anything
            base,
            False,
            library_name="transformers",
            base_model_relation="finetune",
            tags=["lora", "appliance", "merged"],
        )
        + f"\n# {Path(adapter).name or adapter}, merged\n\n`{base.name}` with the LoRA adapter "
        f"`{adapter}` merged into its weights (W + B·A·alpha/r, computed in fp32, stored in the "
        "base model's dtype) by `appliance export`. It loads with transformers alone:\n\n"
        f"```python\nfrom transformers import {base.loader}\n\n"
        f'model = {base.loader}.from_pretrained("{output}")\n```\n\n'
        f"## Training\n\n{_table(rows)}"
    )


def full_card(record: dict[str, Any], base: BaseModel, output: str) -> str:
    """The card of the model a completed full fine-tune (--finetuning-type full) wrote."""
    name = output.rstrip("/").rsplit("/", 1)[-1] or output
    return (
        _front_matter(
            base,
            True,
            library_name="transformers",
            base_model_relation="finetune",
            tags=["full-finetune", "appliance"],
        )
        + f"\n# {name}\n\n`{base.name}` with every weight fine-tuned by appliance. It loads "
        f"with transformers alone:\n\n```python\nfrom transformers import {base.loader}\n\n"
        f'model = {base.loader}.from_pretrained("{output}")\n```\n\n'
        f"## Training\n\n{_table(training_rows(record, base, {}))}"
    )


def write_adapter_card(record: dict[str, Any], base: BaseModel, output: str) -> str | None:
    """Write the adapter's card into `output` (local or s3://); a full fine-tune's, the
    model's. Returns a note for the user when a README.md there is not appliance's: it is left
    as it is and no card is written."""
    uri = storage.join(output, CARD)
    if is_ours(uri) is False:
        return f"{uri} is not a card appliance wrote: left as it is (no model card written)"
    if record["config"].get("finetuning_type") == "full":
        storage.write_bytes(uri, full_card(record, base, output).encode())
        return None

    adapter_config = json.loads(storage.read_bytes(storage.join(output, ADAPTER_CONFIG)))
    storage.write_bytes(uri, adapter_card(record, base, output, adapter_config).encode())
    return None


def completed_record(adapter_dir: Path) -> dict[str, Any] | None:
    """The run.json beside an adapter, when it records a completed run (whose adapter it is)."""

    record = json_object(adapter_dir / RUN_FILE)
    ok = record is not None and record.get("status") == "complete"
    return record if ok and isinstance(record.get("config"), dict) else None


def checkpoint_record(adapter_dir: Path) -> dict[str, Any] | None:
    """For a checkpoint's adapter (`OUTPUT/checkpoints/step-N`), a record of the run up to that
    step in run.json's form, from the checkpoint's config and driver state; None otherwise."""

    if not (adapter_dir / MANIFEST).is_file():
        return None
    config = json_object(adapter_dir / CONFIG_FILE)
    state = json_object(adapter_dir / DRIVER_STATE)
    if config is None or state is None:
        return None
    losses = state.get("losses")
    if state.get("history"):  # in the segments beside the checkpoints (storage/history.py)
        from appliance.errors import ApplianceError
        from appliance.storage.history import read_chain

        checkpoints = str(adapter_dir.parent)  # OUTPUT/checkpoints
        try:
            losses = read_chain(checkpoints, state["history"], state["history_steps"])[0]
        except (OSError, ValueError, KeyError, ApplianceError):  # a copy without them: no row
            losses = None
    record = {"config": config, "steps": state.get("step", 0), "losses": losses}
    record.update(target_tokens=state.get("target_tokens"), trainers=state.get("trainers", 1))
    if config.get("dtype") not in (None, "auto"):  # resolved when the run started
        record.update(dtype=config["dtype"], device=config.get("device"))
    evals = state.get("eval_losses") or []
    if evals and evals[-1][0] == record["steps"]:  # validated at this step
        record["eval_loss"] = evals[-1][1]
    return record


def today() -> str:
    return datetime.date.today().isoformat()


def appliance_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("appliance")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(source tree)"
