"""What defines a run and the record of it in its output directory (run.json): the identity keys
a resumed run must keep, and the file `appliance train` writes as the run starts, stops and ends.
(The lock that keeps two `appliance train` processes from writing one output is output_lock.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

from appliance.config import TrainConfig
from appliance.data.listing import file_names, some_of
from appliance.errors import ConfigError, appliance_command
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    CONFIG_FILE,
    MANIFEST,
    RUN_FILE,
    CheckpointError,
    json_object,
    load_latest_checkpoint,
)
from appliance.storage.output_lock import output_lock

#: what an unreadable run.json is kept as, beside the one rebuilt from a checkpoint
UNREADABLE = ".unreadable"

# the keys that define a run: changing one makes an existing output a different run
IDENTITY_KEYS = (
    "model",
    "data",
    "seq_len",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "seed",
    "micro_batch_size",
    "micro_batches_per_step",
    "base_quant",
    "packing",
    "eval_split",
    "long_documents",
    "mix_data",
    "data_weight",
    "finetuning_type",
    "freeze_embeddings",
)
# what a run.json written before an identity key existed meant by its absence: such a run packed
# documents as one stream, had an unquantized base and no held-out split, and trained LoRA
LEGACY_IDENTITY = {
    "base_quant": "none",
    "packing": "stream",
    "eval_split": None,
    "long_documents": "split",
    "mix_data": [],
    "data_weight": 1.0,
    "finetuning_type": "lora",
    "freeze_embeddings": False,
}


def run_identity(cfg: TrainConfig) -> dict:
    d = cfg.to_dict()
    return {k: d[k] for k in IDENTITY_KEYS}


def model_fingerprint(model: str | None) -> str | None:
    """What a local model directory holds, cheaply: config.json, tokenizer.json, and each
    safetensors file's name, size, header (names, dtypes, shapes, offsets) and 4 KiB of its
    weights at 16 places, hashed. It lets a resumed run follow its model to a new path (a moved
    directory, another mount point in a container) while another model is refused, one of the
    same shapes too (a base model and its chat fine-tune differ in every weight sampled). None
    for s3:// (the driver fingerprints an s3:// model's local copy) or a path that is not there."""
    if not model or storage.is_s3(model) or not Path(model).is_dir():
        return None
    root, h = Path(model), hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            header = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(fh.read(min(header, 2**26)))
            _sample(fh, 8 + header, size, h)
    return h.hexdigest()


def _sample(fh: BinaryIO, start: int, end: int, h: hashlib._Hash, places: int = 16) -> None:
    """Hash 4 KiB of `fh` at `places` evenly spaced places in [start, end) (all of it when
    shorter)."""
    if end - start <= places * 4096:
        fh.seek(start)
        h.update(fh.read(end - start))
        return
    for i in range(places):
        fh.seek(start + (end - start) * i // places)
        h.update(fh.read(4096))


#: a dataset of more files is fingerprinted by 4 KiB of each, and its run.json names none of them
NAMED_DATA_FILES = 1000


def data_fingerprint(path: str | Path, files: list[Path]) -> dict:
    """What a dataset (`path`, its data `files` in document order) holds, cheaply: each file's
    name (relative to `dataset_root`), size and a hash of 4 KiB at 16 places (the whole file when
    under 64 KiB), and a digest of the sizes and hashes in order. The data cursors of a run count
    documents in that order, so a resumed run checks its data against it: the same digest is the
    same data (at a new path too, files renamed alike), another one is named by `data_changes`.
    Past NAMED_DATA_FILES files (a corpus of one document per file), 4 KiB of each is hashed and
    only their count is kept beside the digest: run.json stays small."""
    entries, h = [], hashlib.sha256()
    places = 16 if len(files) <= NAMED_DATA_FILES else 1
    for name, f in zip(file_names(path, files), files, strict=True):  # the names workers get
        size, sampled = f.stat().st_size, hashlib.sha256()
        with open(f, "rb") as fh:
            _sample(fh, 0, size, sampled, places)
        entries.append([name, size, sampled.hexdigest()[:16]])
        h.update(f"{size}\0{entries[-1][2]}\0".encode())
    named = entries if len(entries) <= NAMED_DATA_FILES else None
    return {"digest": h.hexdigest(), "count": len(entries), "files": named}


def data_changes(was: dict, now: dict) -> str:
    """How the dataset of fingerprint `now` differs from the run's (`was`), by file name (by
    their number where either is past NAMED_DATA_FILES)."""
    if was.get("files") is None or now.get("files") is None:
        then = was.get("count", len(was.get("files") or []))
        if then == now["count"]:
            return f"the same number of files ({then:,}), and some of them changed"
        return f"{then:,} files then, {now['count']:,} now"
    old = {name: (size, sampled) for name, size, sampled in was["files"]}
    new = {name: (size, sampled) for name, size, sampled in now["files"]}
    added = [name for name in new if name not in old]
    removed = [name for name in old if name not in new]
    changed = [
        name
        if new[name][0] == old[name][0]
        else f"{name}: {old[name][0]:,} → {new[name][0]:,} bytes"
        for name in new
        if name in old and new[name] != old[name]
    ]
    said = [
        f"{len(names)} file(s) {what} ({some_of(names, 3)})"
        for what, names in (("added", added), ("removed", removed), ("changed", changed))
        if names
    ]
    return "; ".join(said) or "its files are in another order"


def write_run_file(
    cfg: TrainConfig,
    status: str,
    extra: dict | None = None,
    fingerprint: str | None = None,
    data: dict | None = None,
    eval_data: dict | None = None,
) -> None:
    """Write `output`/run.json. `fingerprint`: the model's (model_fingerprint), `data` and
    `eval_data`: the data's and --eval-data's (data_fingerprint), each computed once per run by
    its caller (`Run.record`); None for a record that cannot follow a moved model or check its
    data on resume."""
    record = {
        "identity": run_identity(cfg),
        "config": cfg.to_dict(),
        "status": status,
        "model_fingerprint": fingerprint,
        "data_fingerprint": data,
        "eval_data_fingerprint": eval_data,
        **(extra or {}),
    }
    storage.write_bytes(storage.join(cfg.output, RUN_FILE), json.dumps(record, indent=2).encode())


def adapter_run_config(adapter_dir: Path) -> tuple[dict, Path] | None:
    """The resolved config of the run that wrote the adapter in `adapter_dir`, and the file it
    was read from: run.json beside a run's adapter (its --output), or a checkpoint's config.json
    (beside its manifest). None for an adapter from elsewhere (PEFT's) or a file that does not
    parse: the adapter's own adapter_config.json is then all there is."""

    run_file, checkpoint_config = adapter_dir / RUN_FILE, adapter_dir / CONFIG_FILE
    if run_file.is_file():
        path, config = run_file, (json_object(run_file) or {}).get("config")
    elif (adapter_dir / MANIFEST).is_file():
        path, config = checkpoint_config, json_object(checkpoint_config)
    else:
        return None
    return (config, path) if isinstance(config, dict) else None


def other_model_note(adapter_dir: Path, model_dir: Path, model: str) -> str | None:
    """A note when `model` (its local copy `model_dir`), given to eval or export with the adapter
    in `adapter_dir`, is not the model the adapter's run trained: its files differ from the
    fingerprint in the run's run.json (beside the adapter, or two levels up from a checkpoint).
    One of the same shapes loads without a word otherwise, and scores or merges as another
    model's. None when they match, or when no fingerprint was recorded (a PEFT adapter)."""

    run_file = adapter_dir / RUN_FILE
    if not run_file.is_file() and (adapter_dir / MANIFEST).is_file():
        run_file = adapter_dir.parent.parent / RUN_FILE  # OUTPUT/checkpoints/step-N
    record = (json_object(run_file) if run_file.is_file() else None) or {}
    recorded = record.get("model_fingerprint")
    if not recorded or model_fingerprint(str(model_dir)) == recorded:
        return None
    trained = record.get("config", {}).get("model", "another model")
    return (
        f"--model {model} is not the model the adapter's run trained ({trained}): their files "
        "differ (config, tokenizer or weights), so the adapter meets other weights than it "
        "learned on"
    )


def read_run_file(output: str) -> dict | None:
    """The record in `output`/run.json, or None when there is none. A record that is not a JSON
    object (a torn or hand-edited file) is a ConfigError saying what to do: it is never guessed
    at, since resuming decides from it."""
    run_file = storage.join(output, RUN_FILE)
    if not storage.exists(run_file):
        return None
    record, why = _parse_record(storage.read_bytes(run_file))
    if record is None:
        checkpoint = _latest_config(output)
        keep = (
            f"; or continue the run from its latest checkpoint ({checkpoint[0]}): "
            f"{appliance_command()} train --output {output} --resume rebuilds {RUN_FILE} from it"
            if checkpoint is not None
            else ""
        )
        raise ConfigError(
            f"{run_file} is unreadable: {why}. It records the run in --output {output}: restore "
            f"it{keep}; or pass --overwrite to replace that run (its checkpoints and adapter go; "
            "other files stay)"
        )
    return record


def _parse_record(data: bytes) -> tuple[dict | None, str]:
    """run.json's record, or None and why it is not one."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"it is not JSON ({e})"
    if not isinstance(record, dict):
        return None, f"it holds a JSON {type(record).__name__}, not the run's record"
    return record, ""


def _latest_config(output: str) -> tuple[str, dict] | None:
    """The latest good checkpoint of the run in `output` and the resolved config it holds (every
    checkpoint has one: CONFIG_FILE), or None when there is no such checkpoint."""

    try:
        checkpoint = load_latest_checkpoint(output, only=(CONFIG_FILE,))
    except CheckpointError:  # every one damaged: nothing to rebuild from
        return None
    if checkpoint is None or CONFIG_FILE not in checkpoint.files:
        return None
    config = checkpoint.json(CONFIG_FILE)
    return (checkpoint.uri, config) if isinstance(config, dict) else None


def rebuild_unreadable_run_file(output: str) -> str | None:
    """A --resume of an `output` whose run.json is unreadable (torn by a full disk, hand-edited)
    but whose checkpoints are good: run.json is written again from the latest checkpoint's
    resolved config, as the run recorded it at that step, and the unreadable file is kept beside
    it (RUN_FILE + UNREADABLE). Returns the note that says so; None when run.json is readable,
    missing, or there is no checkpoint to rebuild it from (read_run_file then says what to do).

    The rebuilt record has no fingerprints of the model and data (they were in the lost file):
    this resume knows them by their paths alone, and records them afresh as it starts."""
    run_file = storage.join(output, RUN_FILE)
    if not storage.exists(run_file):
        return None
    damaged = storage.read_bytes(run_file)
    record, why = _parse_record(damaged)
    found = _latest_config(output) if record is None else None
    if found is None:
        return None
    uri, config = found
    kept = run_file + UNREADABLE
    with output_lock(output):  # no run writes it meanwhile
        storage.write_bytes(kept, damaged)  # first: what was there is never lost
        storage.write_bytes(run_file, json.dumps(_rebuilt(config, uri), indent=2).encode())
    return (
        f"{run_file} was unreadable ({why}): rebuilt it from the latest checkpoint {uri}, and "
        f"kept the unreadable file as {kept}. The run's model and data are known by their "
        "paths alone for this resume: their files are not checked against the run's"
    )


def _rebuilt(config: dict, checkpoint: str) -> dict:
    """run.json's record as rebuilt from a checkpoint's resolved `config`."""
    identity = {**LEGACY_IDENTITY, **{k: config[k] for k in IDENTITY_KEYS if k in config}}
    return {
        "identity": identity,
        "config": config,
        "status": "interrupted",
        "model_fingerprint": None,
        "data_fingerprint": None,
        "eval_data_fingerprint": None,
        "rebuilt_from": checkpoint,
    }
