"""`appliance eval`: mean next-token loss of a base model (+ LoRA adapter) on a .jsonl file.

Each record `{"text": ...}` is tokenized on its own (`encode(text, add_special_tokens=True)`, so
the tokenizer's BOS is included), truncated to `seq_len` tokens, and scored as one sequence: a
record of n tokens predicts its n-1 next tokens. The result is the summed NLL over all records
divided by the number of predicted tokens, i.e. what transformers' model gives summed over the
same sequences. No EOS is appended and records are never packed together.

The forward pass is the training engine's (StreamedEngine.eval_loss), so a model larger than the
GPU is evaluated the same way it is trained: block by block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from . import data, hf_checkpoint
from .data import DataError, RawDocument, parse_document
from .engine import MicroBatch, StreamedEngine
from .errors import ConfigError
from .lora import load_adapter
from .weight_store import local_source

DEFAULT_BATCH_TOKENS = 16384  # tokens per engine call: bounds activation memory, not the result


def read_records(data_path: str | Path) -> Iterator[tuple[str, str]]:
    """(`file:line`, text) for each non-blank line of a .jsonl file; DataError on a bad record."""
    path = Path(data_path)
    if path.is_dir():
        raise ConfigError(f"--data {data_path} is a directory; eval reads one .jsonl file")
    if not path.is_file():
        raise ConfigError(f"--data {data_path}: no such file (expected a .jsonl file)")
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            record = parse_document(RawDocument(lineno, where, line, "jsonl"))
            if record.text is None:
                raise DataError(
                    f'{where}: record has "prompt" + "completion" but no "text"; '
                    'eval scores {"text": ...} records'
                )
            yield where, record.text


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The model's tokenizer.json, loaded as the training pipeline loads it."""
    return data.load_tokenizer(hf_checkpoint.tokenizer_path(model_dir))


def encode_records(data_path: str | Path, tokenizer: Tokenizer, seq_len: int) -> list[list[int]]:
    """Token ids of every record, truncated to `seq_len`; records under 2 tokens are dropped."""
    out = []
    for _, text in read_records(data_path):
        ids = tokenizer.encode(text, add_special_tokens=True).ids[:seq_len]
        if len(ids) >= 2:  # one token predicts nothing
            out.append(ids)
    return out


def micro_batch(ids: list[int]) -> MicroBatch:
    """One record as a (1, n) micro-batch; labels[t] = ids[t+1], the last position has none."""
    x = torch.tensor([ids], dtype=torch.long)
    labels = torch.full_like(x, -100)
    labels[0, :-1] = x[0, 1:]
    return x, labels


def groups(seqs: list[list[int]], batch_tokens: int) -> Iterator[list[list[int]]]:
    """Consecutive records, at most `batch_tokens` tokens per group (at least one record)."""
    group: list[list[int]] = []
    n = 0
    for ids in seqs:
        if group and n + len(ids) > batch_tokens:
            yield group
            group, n = [], 0
        group.append(ids)
        n += len(ids)
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
) -> dict:
    """{"loss": summed next-token NLL / predicted tokens, "tokens": predicted tokens}.

    ConfigError for bad arguments, ModelError for an unusable model or adapter, DataError naming
    `file:line` for a malformed record. An empty result (no record of ≥ 2 tokens) is an error.
    """
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be ≥ 2 (one token predicts nothing), got {seq_len}")
    if batch_tokens < 1:
        raise ConfigError(f"batch_tokens must be ≥ 1, got {batch_tokens}")
    args = hf_checkpoint.read_model_args(model_dir)  # refuses unsupported models before any work
    problems = hf_checkpoint.seq_len_problems(args, seq_len)
    if problems:
        raise ConfigError("\n".join(problems))
    hf_checkpoint.SafetensorsCheckpoint(model_dir).check(args)
    seqs = encode_records(data_path, load_tokenizer(model_dir), seq_len)
    if not seqs:
        raise DataError(
            f"{data_path}: no record has 2 or more tokens; nothing to evaluate "
            "(is the file empty, or --seq-len too small?)"
        )
    # Longest first: the engine sizes its GPU plan on the first call, which must be the biggest.
    seqs.sort(key=len, reverse=True)

    # The flat layout the trainers use, without Ray: one host copy of the weights, which a CUDA
    # engine page-locks and uploads in place (no second packed copy).
    source = local_source(model_dir, str(dtype).removeprefix("torch."), base_quant)
    lora = load_adapter(adapter_dir, args, device) if adapter_dir is not None else None
    engine = StreamedEngine(source, lora, device=device, dtype=dtype)
    try:
        total, n = 0.0, 0
        for group in groups(seqs, batch_tokens):
            nll, count = engine.eval_loss([micro_batch(ids) for ids in group])
            total += nll
            n += count
    finally:
        engine.close()
    return {"loss": total / n, "tokens": n}
