"""TrainConfig: every field of a run, each a config-file key and a flag, with its default, its
help (what --help prints), its choices and its help group; and the demo's settings."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    mix_data: tuple[str, ...] = _f(
        (),
        "Further datasets mixed with --data, each PATH=WEIGHT (any --data form): a weight is how "
        "many times its documents are read per epoch (2: twice; 0.5: half, the other half the "
        "next epoch), interleaved evenly (in a config file also a mapping {PATH: WEIGHT}).",
    )
    data_weight: float = _f(1.0, "The weight of --data in a mixture with --mix-data.")
    output: str | None = _f(
        None, "Where the adapter and checkpoints go (directory or s3:// prefix)."
    )
    # ---- how long
    steps: int | None = _f(
        None, "Optimizer steps to run (default: 1 epoch when --epochs is unset)."
    )
    epochs: int | None = _f(None, "Passes over the data (alternative to --steps).")
    # the keys a layer set (flags, config file, the resumed run's record), as build_config
    # found them; not a setting: what a run may choose for itself, given none (the GPU's
    # micro-batch shape, plan/shape.py). Empty for a TrainConfig made directly.
    given: ClassVar[frozenset[str]] = frozenset()
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
    warmup_ratio: float | None = _f(
        None,
        "Warm-up as a fraction of the run's steps, as Hugging Face and axolotl write it "
        "(ceil(ratio × steps)); when given it replaces --warmup-steps.",
    )
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
        "modules: qkv, gate_up, which q,k,v and gate,up also name; a mixture of experts: "
        "q,k,v,o by default, and `experts` for every expert's gate_up and down; Qwen3.5's "
        "linear attention: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj); PEFT's "
        "names too: q_proj, ..., down_proj, all-linear (all seven).",
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
    kernels: str = _f(
        "auto",
        "Which block kernels: exact (the numbers bitwise those of transformers + PEFT) | fast "
        "(faster kernels held to an accuracy rule instead: no further from an fp64 reference "
        "than 3x exact's bf16 error; today one matmul for the A's of q,k,v and one for gate,up "
        "where LoRA dropout is 0) | auto (the fastest tier that passes on the device: exact "
        "until a GPU measures fast faster). --compile-blocks is also a fast-tier choice: a run "
        "with it records the fast tier.",
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
    long_documents: str = _f(
        "split",
        "A document longer than --seq-len: split (into rows of --seq-len, every token trained; "
        "a chat's answer may train without its prompt) | truncate (its first --seq-len tokens) "
        "| drop (left out). The run says how many there are.",
    )
    chat_template: str | None = _f(
        None,
        "Chat template for conversation records (messages, ShareGPT, Alpaca) instead of the "
        "model's (tokenizer_config.json chat_template, or chat_template.jinja): a built-in name "
        "(chatml, llama3, gemma, mistral: as those models publish them) or a jinja file.",
    )
    field_messages: str | None = _f(
        None,
        "The record key holding a conversation's list of messages, when it is not messages or "
        "conversations (axolotl's field_messages).",
    )
    message_property_mappings: tuple[str, ...] = _f(
        (),
        "A message's keys for its role and content when they are not role/content (or "
        "ShareGPT's from/value): role=KEY,content=KEY (axolotl's message_property_mappings; in "
        "a config file also a mapping {role: KEY, content: KEY}).",
    )
    roles: tuple[str, ...] = _f(
        (),
        "The names a dataset gives the roles, beside system/user/assistant/tool and ShareGPT's "
        "human/gpt: ROLE=NAME,... e.g. user=usr,assistant=bot (axolotl's roles; in a config "
        "file also a mapping {user: [usr, person], assistant: [bot]}).",
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
        "card, history.jsonl, run.json. Never touches other files (another tool's checkpoints, "
        "notes, data); an "
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
    # ---- experiment tracking (appliance/tracking/, docs/tracking.md)
    report_to: tuple[str, ...] = _f(
        (),
        "Experiment trackers to send the run's figures, config and adapter to, as the Hugging "
        "Face Trainer names them: tensorboard, mlflow, wandb, trackio (comma-separated or "
        "repeated), or none. Each needs its package: pip install 'appliance[tracking]'.",
        multiple=True,
    )
    logging_dir: str | None = _f(
        None, "--report-to tensorboard: where its event files go (default: OUTPUT/runs)."
    )
    wandb_project: str | None = _f(None, "W&B project (default: WANDB_PROJECT, else appliance).")
    wandb_entity: str | None = _f(None, "W&B entity, a team or user (default: WANDB_ENTITY).")
    wandb_name: str | None = _f(None, "W&B run name (default: WANDB_NAME, else the output's name).")
    wandb_mode: str | None = _f(
        None, "W&B mode: online | offline | disabled (default: WANDB_MODE, else online)."
    )
    wandb_run_id: str | None = _f(
        None, "Continue this W&B run id (default: a new one; a resumed run keeps its own)."
    )
    mlflow_tracking_uri: str | None = _f(
        None,
        "MLflow tracking server or store: http(s)://..., sqlite:///path.db, ... (default: "
        "MLFLOW_TRACKING_URI, else MLflow's default, sqlite:///mlflow.db in the working dir).",
    )
    mlflow_experiment_name: str | None = _f(
        None, "MLflow experiment (default: MLFLOW_EXPERIMENT_NAME, else MLflow's Default)."
    )
    mlflow_run_name: str | None = _f(None, "MLflow run name (default: the output's name).")
    object_store_memory: str | None = _f(
        None,
        "Ray object store size for embedded Ray, e.g. 100GiB; it holds the base model's weights "
        "(default: what /dev/shm holds, less a margin).",
    )

    def lora_spec(self):

        return LoraSpec(
            self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets)
        )

    def mixture(self) -> list[tuple[str, float]]:
        """--mix-data's (path, weight) pairs (validated by config.build: a weight > 0)."""
        out = []
        for item in self.mix_data:
            path, _, weight = item.rpartition("=")
            out.append((path.strip(), float(weight)))
        return out

    def field_map(self):
        """The data's conversation shape (data.chat.FieldMap) from --field-messages,
        --message-property-mappings and --roles; None when none is given (validated by
        config.build: keys role/content, roles among system/user/assistant/tool)."""
        from appliance.data.chat import FieldMap

        if not (self.field_messages or self.message_property_mappings or self.roles):
            return None
        keys = dict(pair_items(self.message_property_mappings))
        names = tuple((name, role) for role, name in pair_items(self.roles))
        return FieldMap(self.field_messages, keys.get("role"), keys.get("content"), names)

    def budget_bytes(self) -> int | None:
        return parse_bytes(self.gpu_memory_budget) if self.gpu_memory_budget else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "base_quant": ("none", "int8", "nf4"),
    "finetuning_type": ("lora", "full"),
    "on_bad_record": ("fail", "skip"),
    "packing": ("documents", "stream"),
    "kernels": ("auto", "exact", "fast"),
    "long_documents": ("split", "truncate", "drop"),
    "log_format": ("auto", "rich", "json", "plain"),
    "metrics_host": ("127.0.0.1", "0.0.0.0"),
}

# `train --help` shows its flags in these groups, in this order; a flag not listed lands in
# "Other options". A new flag: add its field name to one group.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "Model and data": (
        "config",
        "model",
        "data",
        "mix_data",
        "data_weight",
        "output",
        "steps",
        "epochs",
        "seq_len",
    ),
    "What trains": ("finetuning_type", "freeze_embeddings"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
    "Optimisation": (
        "micro_batch_size",
        "micro_batches_per_step",
        "lr",
        "warmup_steps",
        "warmup_ratio",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "seed",
    ),
    "Hardware": (
        "device",
        "dtype",
        "base_quant",
        "kernels",
        "compile_blocks",
        "gpu_memory_budget",
        "object_store_memory",
        "trainers",
        "cluster",
    ),
    "Data pipeline": (
        "packing",
        "long_documents",
        "chat_template",
        "field_messages",
        "message_property_mappings",
        "roles",
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
    "Experiment tracking": (
        "report_to",
        "logging_dir",
        "wandb_project",
        "wandb_entity",
        "wandb_name",
        "wandb_mode",
        "wandb_run_id",
        "mlflow_tracking_uri",
        "mlflow_experiment_name",
        "mlflow_run_name",
    ),
}
WANDB_MODES = ("online", "offline", "disabled")

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


def pair_items(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """`KEY=VALUE` items as (key, value) pairs (an item without `=`: (item, ""))."""
    return [(k.strip(), v.strip()) for k, _, v in (item.partition("=") for item in items)]


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
