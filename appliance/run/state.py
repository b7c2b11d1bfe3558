"""What a run is and where it is: its inputs, checked and resolved before any actor starts
(`Inputs`), and its resumable state (`RunState`, the driver's part of every checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from appliance.config import TrainConfig
from appliance.data.chat import ChatTemplate


@dataclass
class Inputs:
    """Everything checked and resolved before the actors start (on the trainer's node with
    --cluster, so the paths are that node's)."""

    cfg: TrainConfig
    model_dir: Path
    data_path: Path
    eos_id: int
    pad_id: int | None
    device: str
    dtype: str
    eval_data: Path | None = None
    chat_template: ChatTemplate | None = None  # the model's, or --chat-template's
    notes: list[str] = field(default_factory=list)  # for the user, e.g. files the data skipped
    model_fingerprint: str | None = None  # of model_dir (run_record), for run.json
    data_fingerprint: dict | None = None  # of data_path (run_record), for run.json
    data_files: list[str] | None = None  # data_path's files when the run started, by name
    documents: int | None = None  # data_path's documents, counted up to MAX_DEFAULT_WORKERS
    eval_data_fingerprint: dict | None = None  # of eval_data, likewise
    mix_files: list[list[str]] = field(default_factory=list)  # --mix-data's files, by name


@dataclass
class RunState:
    """Where the run is: enough to resume it exactly."""

    step: int = 0
    consumed: int = 0  # micro-batches consumed so far (position in the worker schedule)
    cursors: dict[int, dict] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    target_tokens: int = 0  # tokens trained on (labels != -100)
    skipped: dict[int, int] = field(default_factory=dict)  # bad records skipped, per worker
    tokenizer_pids: set[int] = field(default_factory=set)  # processes that tokenized
    row_tokens: int = 0  # input positions of every row trained on (targets / this = packing)
    eval_losses: list[list] = field(default_factory=list)  # [step, validation loss]
    skipped_steps: int = 0  # float16: steps whose gradient overflowed (no update; loss_scale.py)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "consumed": self.consumed,
            "cursors": {str(w): c for w, c in self.cursors.items()},
            "losses": self.losses,
            "target_tokens": self.target_tokens,
            "skipped": {str(w): n for w, n in self.skipped.items()},
            "row_tokens": self.row_tokens,
            "eval_losses": self.eval_losses,
            "skipped_steps": self.skipped_steps,
        }

    @classmethod
    def from_json(cls, d: dict) -> RunState:
        return cls(
            step=d["step"],
            consumed=d["consumed"],
            cursors={int(w): c for w, c in d["cursors"].items()},
            losses=list(d["losses"]),
            target_tokens=d["target_tokens"],
            skipped={int(w): n for w, n in d["skipped"].items()},
            row_tokens=d.get("row_tokens", 0),
            eval_losses=list(d.get("eval_losses", [])),
            skipped_steps=d.get("skipped_steps", 0),
        )
