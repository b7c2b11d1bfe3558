"""`appliance eval`: mean next-token loss of a base model (+ LoRA adapter) on a dataset.

The dataset is read exactly as `train` reads it (any accepted format: `.jsonl`, `.json`,
`.parquet`, `.arrow`, `.txt`, compressed or not, or a directory of them; text, prompt + completion,
and conversations rendered with the model's chat template), and every document has the targets
training gives it (`data/records.py`): a text record predicts every token and the appended EOS, prompt +
completion only the completion and EOS, a conversation only its assistant turns. Each document is
truncated to `seq_len` tokens and scored alone: the result is the summed NLL over the target tokens
of all documents divided by their number, i.e. what transformers' model gives summed over the same
sequences; its exponential is the perplexity, and with an adapter the base model's loss on the
same tokens is given beside it (`with_base`).

The forward pass is the training engine's (StreamedEngine.eval_loss), so a model larger than the
GPU is evaluated the same way it is trained: block by block. `eval_batches` packs the same
documents into rows without cross-document attention, for validation during training: the same
loss, fewer engine calls.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from appliance.actors.weight_store import local_source
from appliance.data import records as data
from appliance.data.chat import ChatError, ChatTemplate, FieldMap, load_chat_template
from appliance.data.listing import find_data_files, is_pattern, named_files
from appliance.data.mixture import MixedShardReader, Source
from appliance.data.packing import fill_rows
from appliance.data.records import (
    SKIP_EXAMPLES,
    Batch,
    DataError,
    Holdout,
    ShardReader,
    parse_document,
    skipped_message,
    with_skip_hint,
)
from appliance.engine.batches import MicroBatch
from appliance.engine.step import StreamedEngine
from appliance.errors import ConfigError
from appliance.models import hf_checkpoint
from appliance.models.layers import IGNORE_INDEX
from appliance.models.lora import LoraSpec, LoraWeights, load_adapter
from appliance.storage import uri as storage
from appliance.storage.localize import localize, localize_data

DEFAULT_BATCH_TOKENS = 16384  # tokens per engine call: bounds activation memory, not the result

Document = tuple[np.ndarray, np.ndarray]  # (ids int64, target mask bool), as records.encode_records


def read_documents(
    data_path: str | Path,
    tokenizer: Tokenizer,
    eos_id: int,
    seq_len: int,
    chat: ChatTemplate | None = None,
    holdout: Holdout | None = None,
    on_bad_record: str = "fail",
    warn: Callable[[str], None] | None = None,
    files: list[str] | None = None,
    fields: FieldMap | None = None,
    mix: list[tuple[str | Path, float, list[str] | None]] | None = None,
) -> list[Document]:
    """Every document of `data_path`, encoded as training encodes it and truncated to `seq_len`
    tokens; documents left without a target are dropped. DataError naming `file:line` (or
    `file:row N`) for a bad record, unless `on_bad_record="skip"` (then it is left out).
    `holdout`: only the documents --eval-split holds out. `warn` is told of skipped records and
    of truncated documents (how many, the tokens not scored). `files`: the data files by name,
    as the run listed them when it started (`listing.file_names`; None: what `data_path`
    names now): --eval-split's documents are counted over those, as the workers count them.
    `fields`: where conversations of another shape keep their messages (chat.FieldMap). `mix`:
    a run's --mix-data (path, weight, files by name): with `holdout`, the documents held out of
    each dataset of the mixture, once (data/mixture.py)."""
    found = find_data_files(data_path) if files is None else named_files(data_path, files)
    records, skipped = [], []
    reader: ShardReader | MixedShardReader = ShardReader(found, 0, 1, holdout=holdout)
    if mix:
        sources = [Source(tuple(found), 1.0)] + [
            Source(tuple(find_data_files(p) if n is None else named_files(p, n)), w)
            for p, w, n in mix
        ]
        reader = MixedShardReader(sources, 0, 1, holdout=holdout)
    for raw in reader:
        try:
            records.append(parse_document(raw, chat, fields))
        except DataError as e:
            if on_bad_record != "skip":
                raise with_skip_hint(e) from None
            skipped.append(str(e))
    if skipped and warn is not None:
        warn(skipped_message(len(skipped), skipped[:SKIP_EXAMPLES], str(data_path)))
    out = []
    lengths = []  # of the documents longer than seq_len
    for ids, mask in data.encode_records(tokenizer, records, eos_id):
        if len(ids) > seq_len:
            lengths.append(len(ids))
        ids, mask = ids[:seq_len], mask[:seq_len]
        if mask[1:].any():  # the first token is never a target
            out.append((ids, mask))
    if lengths and warn is not None:
        warn(
            f"--seq-len {seq_len} cut {len(lengths)} of {len(records)} document(s) of "
            f"{data_path}, so {sum(lengths) - seq_len * len(lengths):,} of their "
            f"{sum(lengths):,} tokens are not scored (the longest has {max(lengths):,}): pass a "
            "larger --seq-len, or split long documents into several records (a .txt file is "
            "one document)"
        )
    return out


def check_device(device: str | torch.device) -> None:
    """ConfigError for --device cuda where no GPU is visible (as `train` says it)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible (use --device cpu or auto)")


def micro_batch(ids: np.ndarray, mask: np.ndarray) -> MicroBatch:
    """One document as a (1, n) micro-batch; labels[t] = ids[t+1] where that token is a target."""
    x = torch.from_numpy(np.array(ids, dtype=np.int64))[None]
    labels = torch.full_like(x, IGNORE_INDEX)
    targets = torch.from_numpy(np.array(mask[1:], dtype=bool))
    labels[0, :-1] = torch.where(targets, x[0, 1:], IGNORE_INDEX)
    return x, labels


def eval_batches(
    documents: list[Document], seq_len: int, micro_batch_size: int, pad_id: int
) -> list[Batch]:
    """`documents` (from read_documents) packed into rows of `seq_len` without cross-document
    attention, as micro-batches: their summed NLL is that of scoring each document alone."""
    input_ids, labels, positions, segments = fill_rows(documents, seq_len, pad_id)
    out = []
    for start in range(0, len(input_ids), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        out.append(
            Batch(
                input_ids=input_ids[rows],
                labels=labels[rows],
                cursor={},
                worker=0,
                pid=os.getpid(),
                epoch=0,
                n_tokens=int((labels[rows] != IGNORE_INDEX).sum()),
                skipped_records=0,
                positions=positions[rows],
                segments=segments[rows],
            )
        )
    return out


def validation_batches(cfg, inp, warn: Callable[[str], None] | None = None) -> list[Batch]:
    """The run's validation set (`run_state.Inputs` `inp` of config `cfg`, which has one:
    `Run.has_eval`): --eval-data (the demo's held-out corpus is its --eval-data) or the documents
    --eval-split holds out of --data, as `eval_batches`. Each document is encoded as training
    encodes it, truncated to --seq-len and scored alone (the semantics of `appliance eval`);
    DataError naming the set if a record is bad or none has a target token. `warn`: as in
    `read_documents` (skipped records, documents cut to --seq-len)."""

    holdout = files = None
    mix: list = []
    if cfg.eval_data:
        path = localize_data(cfg.eval_data)
    else:  # --eval-split: the documents the workers skip, counted over the same files
        path = localize_data(cfg.data)
        holdout, files = Holdout(cfg.eval_split, cfg.seed, held_out=True), inp.data_files
        mix = [
            (localize_data(p), w, names)
            for (p, w), names in zip(cfg.mixture(), inp.mix_files, strict=True)
        ]
    # from the model's URI, as the tokenizer workers do: with --cluster this runs in the
    # driver, on the head, and inp's paths are the trainer node's (its S3 cache)
    tokenizer = data.load_tokenizer(localize(storage.join(cfg.model, "tokenizer.json")))
    what = (
        f"--eval-split {cfg.eval_split} (the documents held out of --data)"
        if holdout
        else f"--eval-data {cfg.eval_data}"
    )
    try:
        docs = read_documents(
            path,
            tokenizer,
            inp.eos_id,
            cfg.seq_len,
            inp.chat_template,
            holdout,
            cfg.on_bad_record,
            warn=warn,
            files=files,
            fields=cfg.field_map(),
            mix=mix,
        )
    except DataError as e:  # a record of the validation set: say which set it is
        raise DataError(f"{what}: {e}") from None
    if not docs:
        fix = "raise --eval-split, or check the data" if holdout else "check the data"
        raise DataError(f"{what}: no document has a target token; nothing to validate on ({fix})")
    pad = inp.pad_id if inp.pad_id is not None else inp.eos_id
    return eval_batches(docs, cfg.seq_len, cfg.micro_batch_size, pad)


def groups(seqs: list[Document], batch_tokens: int) -> Iterator[list[Document]]:
    """Consecutive documents, at most `batch_tokens` tokens per group (at least one document)."""
    group: list[Document] = []
    n = 0
    for doc in seqs:
        if group and n + len(doc[0]) > batch_tokens:
            yield group
            group, n = [], 0
        group.append(doc)
        n += len(doc[0])
    if group:
        yield group


def evaluate(
    model_dir: str | Path,
    data_path: str | Path,
    seq_len: int,
    adapter_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    base_quant: str = "none",
    chat_template: str | Path | None = None,
    on_bad_record: str = "fail",
    warn: Callable[[str], None] | None = None,
    holdout: Holdout | None = None,
    fields: FieldMap | None = None,
    with_base: bool = False,
) -> dict:
    """{"loss": summed next-token NLL / target tokens, "tokens": target tokens, "perplexity":
    exp(loss)}; `with_base` (and an adapter): also the base model's, without the adapter, on
    the same tokens ("base_loss", "base_perplexity"), from the same engine (one more pass per
    group of documents).

    ConfigError for bad arguments, ModelError for an unusable model or adapter, DataError naming
    `file:line` for a malformed record (unless `on_bad_record="skip"`) or a tokenizer that is not
    the model's. An empty result (no target token) is an error. `chat_template`: a built-in
    name or a jinja file that overrides the model's (--chat-template). `fields`: where
    conversations of another shape keep their messages (chat.FieldMap). `warn` is told, before the model runs, of
    skipped records and of documents cut to `seq_len`. `holdout`: only the documents a run's
    --eval-split held out of `data_path` (its validation set).
    """
    check_device(device)
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be ≥ 2 (one token predicts nothing), got {seq_len}")
    if batch_tokens < 1:
        raise ConfigError(f"batch_tokens must be ≥ 1, got {batch_tokens}")
    args = hf_checkpoint.read_model_args(model_dir)  # refuses unsupported models before any work
    problems = hf_checkpoint.seq_len_problems(args, seq_len)
    if args.eos_token_id is None:
        problems.append(
            f"{model_dir}/config.json has no eos_token_id, nor does generation_config.json or "
            'the tokenizer (eos_token): documents end with one: add "eos_token_id": ID to '
            "config.json"
        )
    if problems:
        raise ConfigError("\n".join(problems))
    if not (Path(data_path).exists() or is_pattern(data_path)):
        raise ConfigError(f"--data {data_path}: no such file or directory")
    hf_checkpoint.SafetensorsCheckpoint(model_dir).check(args)
    tokenizer_path = hf_checkpoint.tokenizer_path(model_dir)
    tokenizer = data.check_tokenizer_fits(tokenizer_path, args.vocab_size, model_dir)
    try:
        chat = load_chat_template(model_dir, chat_template)
    except ChatError as e:
        raise ConfigError(str(e)) from None
    seqs = read_documents(
        data_path,
        tokenizer,
        int(args.eos_token_id),
        seq_len,
        chat,
        holdout,
        on_bad_record=on_bad_record,
        warn=warn,
        fields=fields,
    )
    if not seqs:
        raise DataError(
            f"{data_path}: no record has a target token; nothing to evaluate "
            "(is it empty, or --seq-len too small?)"
        )
    # Longest first: the engine sizes its GPU plan on the first call, which must be the biggest.
    seqs.sort(key=lambda d: len(d[0]), reverse=True)

    # The flat layout the trainers use, without Ray: one host copy of the weights, which a CUDA
    # engine page-locks and uploads in place (no second packed copy).
    source = local_source(model_dir, str(dtype).removeprefix("torch."), base_quant)
    lora = load_adapter(adapter_dir, args, device) if adapter_dir is not None else None
    engine = StreamedEngine(source, lora, device=device, dtype=dtype)
    base = LoraWeights(args, LoraSpec(targets=())) if with_base and lora is not None else None
    try:
        total, base_total, n = 0.0, 0.0, 0
        for group in groups(seqs, batch_tokens):
            mbs = [micro_batch(ids, mask) for ids, mask in group]
            nll, count = engine.eval_loss(mbs)
            total += nll
            n += count
            if base is not None:  # the same engine, its adapter set aside for one pass
                engine.lora, adapter = base, engine.lora
                try:
                    base_total += engine.eval_loss(mbs)[0]
                finally:
                    engine.lora = adapter
    finally:
        engine.close()
    result = {"loss": total / n, "tokens": n, "perplexity": perplexity(total / n)}
    if base is not None:
        result.update(base_loss=base_total / n, base_perplexity=perplexity(base_total / n))
    return result


def perplexity(loss: float) -> float:
    """exp(mean NLL); inf past what a float holds."""
    return math.exp(loss) if loss < 709 else math.inf
