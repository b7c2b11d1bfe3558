"""TrainConfig: every field of a run, each a config-file key and a flag, with its default, its
help (what --help prints), its choices and its help group; and the demo's settings."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from appliance.models.layers import TARGET_MODULES
from appliance.models.lora import LoraSpec

CHECKPOINT_MINUTES = 10  # the default checkpoint interval, in minutes of training
DEFAULT_METRICS_PORT = 8080  # where Prometheus (compose) and KubeRay look for it


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # ---- what to train
    model: str | None = _f(
        None,
        "Base model: a Hugging Face directory or s3:// prefix (config.json, "
        "*.safetensors, tokenizer.json), or an id (org/name) in the local Hugging Face cache. "
        "Omit for the built-in demo.",
    )
    data: str | None = _f(
        None,
        "Training data: a .jsonl, .json, .parquet, .arrow or .txt file (.jsonl/.json/.txt may "
        "be .gz, .bz2, .xz or .zst compressed), a directory of them, a glob pattern "
        "('data/train-*.jsonl', '**' for any directories; quote it), s3:// (a pattern too), or "
        "a dataset id (org/name, or org/name/data/train-* for one split) in the local Hugging "
        "Face cache.",
    )
    output: str | None = _f(
        None, "Where the adapter and checkpoints go (directory or s3:// prefix)."
    )
    # ---- how long
    steps: int | None = _f(
        None, "Optimizer steps to run (default: 1 epoch when --epochs is unset)."
    )
    epochs: int | None = _f(None, "Passes over the data (alternative to --steps).")
    # ---- shapes
    seq_len: int = _f(256, "Tokens per training row.")
    micro_batch_size: int = _f(4, "Rows per micro-batch (one forward through a block).")
    micro_batches_per_step: int | str = _f(
        4,
        "Micro-batches per optimizer step; each block's weights are "
        "transferred once per pass for all of them. auto: on a GPU, measure host→device "
        "bandwidth and matmul rate at start and take the smallest M within 10% of "
        "compute-bound that fits (appliance plan's rule); 4 on a CPU.",
    )
    # ---- optimisation
    lr: float = _f(2e-4, "Peak learning rate (AdamW).")
    warmup_steps: int = _f(10, "Linear warm-up steps before the cosine decay.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of --lr.")
    weight_decay: float = _f(0.0, "AdamW weight decay on the LoRA parameters.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = _f(0, "Seed for LoRA init, dropout and data order.")
    # ---- what trains
    finetuning_type: str = _f(
        "lora",
        "lora (an adapter; the base stays frozen) | full (every weight trains: fp32 master "
        "weights and AdamW moments in host memory, 12 B per parameter; the output is the whole "
        "model in the Hugging Face layout). LLaMA-Factory's name for the same choice.",
    )
    freeze_embeddings: bool = _f(
        False,
        "With --finetuning-type full: the input embeddings do not train (no gradient, master or "
        "moments for them; with tied embeddings the LM head is frozen too).",
    )
    # ---- LoRA
    lora_rank: int = _f(16, "LoRA rank r.")
    lora_alpha: float = _f(32.0, "LoRA alpha (scale = alpha / rank).")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input.")
    lora_targets: tuple[str, ...] = _f(
        tuple(TARGET_MODULES),
        "Modules to adapt, comma-separated: " + ",".join(TARGET_MODULES) + " (Phi-3's fused "
        "modules: qkv, gate_up, which q,k,v and gate,up also name).",
    )
    # ---- hardware
    device: str = _f("auto", "auto | cpu | cuda.")
    dtype: str = _f(
        "auto",
        "Compute dtype: auto (bfloat16 on GPU, float16 with loss scaling on a GPU without bf16, "
        "float32 on CPU) | float32 | bfloat16 | float16.",
    )
    gpu_memory_budget: str | None = _f(
        None, "Cap the appliance's GPU memory, e.g. 24GiB; blocks beyond it are streamed."
    )
    base_quant: str = _f(
        "none",
        "Store the base model's linear weights quantized (QLoRA): none | int8 (per row) | nf4 "
        "(4-bit NormalFloat, blocks of 64); a half or a quarter of the host memory and transfers.",
    )
    compile_blocks: bool = _f(
        False,
        "Run the transformer blocks through torch.compile: fused kernels, fewer launches (the "
        "first step compiles them). Off: the eager blocks, bitwise equal to transformers + PEFT.",
    )
    trainers: int | None = _f(
        None,
        "Trainers, one per GPU, training one adapter data-parallel; each takes "
        "--micro-batches-per-step micro-batches per step (default: every GPU Ray sees, 1 on CPU; "
        "with --cluster, every GPU of the trainer nodes, one per trainer node without GPUs).",
    )
    # ---- data pipeline
    tokenize_workers: int | None = _f(
        None, "Tokenizer worker actors (default: the CPUs beside the trainer, at most 4)."
    )
    prefetch: int = _f(2, "Optimizer steps' worth of batches kept in flight ahead of the trainer.")
    on_bad_record: str = _f("fail", "fail | skip: what to do with a malformed data record.")
    packing: str = _f(
        "documents",
        "documents (rows hold whole documents; a token attends only to its own document and "
        "positions restart at each) | stream (documents run together, attending across).",
    )
    chat_template: str | None = _f(
        None,
        "Jinja chat template file for conversation records (messages / ShareGPT), instead of "
        "the model's (tokenizer_config.json chat_template, or chat_template.jinja).",
    )
    # ---- validation during training
    eval_data: str | None = _f(
        None, "Held-out data (any --data format) scored during training and at the end."
    )
    eval_split: float | None = _f(
        None,
        "Hold out this fraction of --data's documents for validation (chosen by --seed, never "
        "trained on).",
    )
    eval_every: int | None = _f(
        None, "Validate every N steps on --eval-data / --eval-split (default: only at the end)."
    )
    # ---- output, checkpoints, faults
    checkpoint_every: int | None = _f(
        None,
        "Checkpoint every N steps (default: time-based, the first step boundary after each "
        f"{CHECKPOINT_MINUTES} minutes of training); always at the end and on Ctrl-C/SIGTERM.",
    )
    keep_checkpoints: int = _f(3, "Checkpoints to keep.")
    resume: bool = _f(False, "Continue the run in --output from its latest checkpoint.")
    auto_resume: bool = _f(
        False,
        "Continue the run in --output if it holds one (as --resume), else start it there: one "
        "command for the first run and every rerun (Kubernetes, docker --restart).",
    )
    overwrite: bool = _f(
        False,
        "Replace the appliance run in --output: removes only what appliance wrote there (where "
        "its run.json or checkpoint manifests show it): adapter_config.json, "
        "adapter_model.safetensors (a full fine-tune's config.json, model*.safetensors and "
        "tokenizer files), checkpoints/step-N and checkpoints/latest, its own README.md "
        "card, run.json. Never touches other files (another tool's checkpoints, notes, data); an "
        "--output with no appliance run is refused, nothing deleted.",
    )
    allow_data_change: bool = _f(
        False,
        "With --resume or --auto-resume: continue although --data's files changed since the run "
        "started (a file whose name sorts after the others' is read after them; other changes "
        "shift what the run reads next). Without it such a resume is refused, naming the files.",
    )
    allow_model_change: bool = _f(
        False,
        "With --resume or --auto-resume: continue although --model's files (config.json, "
        "tokenizer, weights) changed since the run started, or it is another model: the steps "
        "from here train on it as it is now. Without it such a resume is refused.",
    )
    max_restarts: int = _f(3, "Trainer/worker restarts allowed before the run fails.")
    # ---- running
    cluster: str | None = _f(
        None,
        "Run on an existing Ray cluster at this address (or 'auto' for "
        "RAY_ADDRESS) instead of embedded Ray.",
        cli=False,
    )
    log_format: str = _f(
        "auto",
        "auto (rich on a terminal, plain lines otherwise) | rich (live table) | "
        "json (one object per step) | plain (a line every 10 s or 10 steps).",
    )
    metrics_port: int | None = _f(
        None,
        f"Port of the Prometheus metrics endpoint (embedded Ray). Default {DEFAULT_METRICS_PORT}, "
        "or the next free port when that one is taken; a port given here must be free.",
    )
    metrics_host: str = _f(
        "127.0.0.1",
        "Where the metrics endpoint (embedded Ray) listens: 127.0.0.1, this machine only (its "
        "labels name --output paths and buckets), or 0.0.0.0, every interface (a container "
        "whose port is published, a Prometheus on another host).",
    )
    object_store_memory: str | None = _f(
        None,
        "Ray object store size for embedded Ray, e.g. 100GiB; it holds the base model's weights "
        "(default: what /dev/shm holds, less a margin).",
    )

    def lora_spec(self):

        return LoraSpec(
            self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets)
        )

    def budget_bytes(self) -> int | None:
        return parse_bytes(self.gpu_memory_budget) if self.gpu_memory_budget else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "base_quant": ("none", "int8", "nf4"),
    "finetuning_type": ("lora", "full"),
    "on_bad_record": ("fail", "skip"),
    "packing": ("documents", "stream"),
    "log_format": ("auto", "rich", "json", "plain"),
    "metrics_host": ("127.0.0.1", "0.0.0.0"),
}

# `train --help` shows its flags in these groups, in this order; a flag not listed lands in
# "Other options". A new flag: add its field name to one group.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "Model and data": ("config", "model", "data", "output", "steps", "epochs", "seq_len"),
    "What trains": ("finetuning_type", "freeze_embeddings"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
    "Optimisation": (
        "micro_batch_size",
        "micro_batches_per_step",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "seed",
    ),
    "Hardware": (
        "device",
        "dtype",
        "base_quant",
        "gpu_memory_budget",
        "object_store_memory",
        "trainers",
        "cluster",
    ),
    "Data pipeline": (
        "packing",
        "chat_template",
        "tokenize_workers",
        "prefetch",
        "on_bad_record",
    ),
    "Validation": ("eval_data", "eval_split", "eval_every"),
    "Checkpoints and faults": (
        "checkpoint_every",
        "keep_checkpoints",
        "resume",
        "auto_resume",
        "overwrite",
        "allow_data_change",
        "allow_model_change",
        "max_restarts",
    ),
    "Output": ("log_format", "metrics_port", "metrics_host"),
}

# The built-in demo's settings (no --model): small rows, enough steps for the adapter to learn the
# demo grammar. A layer between the defaults and the config file: anything the user sets wins.
DEMO_SETTINGS: dict[str, Any] = dict(
    steps=300,
    seq_len=64,
    micro_batch_size=4,
    micro_batches_per_step=2,
    lr=3e-3,
    warmup_steps=20,
    lora_rank=16,
    lora_alpha=32.0,
)
AUTO = "auto"  # --micro-batches-per-step auto (resolved by the driver at start)
RUN_LENGTH = ("steps", "epochs")  # one choice: setting either replaces the demo's steps


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """'24GiB' → 25769803776; '24GB' → 24e9; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size like 24GiB")
    n, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    if unit == "B":
        return int(n)
    base = 1024 if "I" in unit else 1000
    return int(n * base ** powers[unit[0]])
