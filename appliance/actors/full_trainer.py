"""FullTrainer: a Trainer (actors/trainer.py) whose engine trains every weight
(engine/full.py), and whose output is the whole model in the Hugging Face layout.

What it writes, in a checkpoint (`model/...`) and at the end of a run (at the top of --output):
`config.json` (the base model's, its dtype the compute dtype), the weights as
`model.safetensors`, or `model-0000k-of-0000N.safetensors` shards with
`model.safetensors.index.json` past SHARD_BYTES (transformers' own names and index), and the base
model's tokenizer and generation files: a directory `AutoModelForCausalLM.from_pretrained` loads
as it is. The checkpoint's `trainer_state.pt` holds the fp32 master weights and AdamW moments
(engine/host_adam.py), so a resume continues the exact run in any compute dtype.

Its weights live in the weight store's writable home (actors/weight_home.py), which outlives a
trainer: a recreated trainer puts the checkpoint's weights back into it, or, when the run has
no checkpoint yet, the base model's (read again from its files).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from appliance.actors.trainer import BIG_FILES, Trainer, UntrustedState
from appliance.engine.full import FullFinetuneEngine
from appliance.errors import first_line
from appliance.models import hf_checkpoint
from appliance.storage import uri as storage
from appliance.storage.checkpoints import CheckpointError
from appliance.storage.localize import localize_model

MODEL_DIR = "model"  # a checkpoint's copy of the model, in the Hugging Face layout
HF_CONFIG = "config.json"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
INDEX = "model.safetensors.index.json"
# the base model's files that go beside the weights as they are
COPIED = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja")


_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def written_files(names: list[str]) -> list[str]:
    """Of the file names at the top of an --output (relative, '/'-separated), those a full
    fine-tune writes there (`write_adapter`), config.json first: what --overwrite removes."""
    top = [n for n in names if "/" not in n]
    ours = [
        n
        for n in top
        if n in ("model.safetensors", INDEX, *COPIED)
        or _SHARD.match(n)
        or n.startswith("tokenizer")
    ]
    return ([HF_CONFIG] if HF_CONFIG in top else []) + sorted(ours)


class FullTrainer(Trainer):
    """A data-parallel rank that trains every weight (settings.finetuning_type == "full")."""

    shard_bytes = SHARD_BYTES

    def _make_engine(self, group) -> FullFinetuneEngine:
        options = self._engine_options(group)
        return FullFinetuneEngine(
            self.source, freeze_embeddings=self.settings.freeze_embeddings, **options
        )

    def _big(self, name: str) -> bool:
        return name in BIG_FILES or name.startswith(f"{MODEL_DIR}/")

    # ------------------------------------------------------------ the model files

    def model_files(self) -> dict[str, bytes]:
        """The trained model as file name → bytes, in the Hugging Face layout (module doc)."""
        weights = self.engine.named_weights()
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in weights.items():
            n = t.numel() * t.element_size()
            if shards[-1] and size + n > self.shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.contiguous()
            size += n
        files: dict[str, bytes] = {}
        if len(shards) == 1:
            files["model.safetensors"] = safetensors_bytes(shards[0], {"format": "pt"})
        else:
            weight_map = {}
            for k, shard in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                files[fname] = safetensors_bytes(shard, {"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in weights.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            files[INDEX] = json.dumps(index, indent=2).encode()
        base = self._base_dir()
        config = json.loads((base / HF_CONFIG).read_text())
        config["torch_dtype"] = config["dtype"] = self.settings.dtype
        for f in sorted(base.iterdir()):
            if f.name in COPIED or f.name.startswith("tokenizer"):
                files[f.name] = f.read_bytes()
        files[HF_CONFIG] = json.dumps(config, indent=2).encode()
        return files

    def _base_dir(self) -> Path:
        return Path(localize_model(self.settings.model))

    def adapter_files(self) -> dict[str, bytes]:
        """What a checkpoint holds besides the trainer state: the model, under model/."""
        return {f"{MODEL_DIR}/{k}": v for k, v in self.model_files().items()}

    def write_adapter(self, output: str) -> None:
        """Publish the trained model at the top of `output`: every file, config.json last (a
        directory with config.json beside its weights is a complete model)."""
        files = self.model_files()
        config_uri = storage.join(output, HF_CONFIG)
        if storage.exists(config_uri):
            storage.delete(config_uri)
        for name in sorted(files):
            if name != HF_CONFIG:
                storage.write_bytes(storage.join(output, name), files[name])
        storage.write_bytes(config_uri, files[HF_CONFIG])

    # ------------------------------------------------------------ state

    def state_bytes(self) -> bytes:
        buf = io.BytesIO()
        rng = {"rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        torch.save({"full": True, **rng, **self.engine.state_dict()}, buf)
        return buf.getvalue()

    def load_state_bytes(self, data: bytes) -> int:
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not {"rng", "step"} <= state.keys():
                raise ValueError("it does not hold a trainer's state (rng, step)")
        except Exception as e:  # noqa: BLE001 - whatever the file is, it is not trusted
            raise UntrustedState(
                f"not trusted, not loaded ({type(e).__name__}: {first_line(e)[:200]}): a "
                "checkpoint's trainer state holds tensors and numbers only"
            ) from None
        if not state.get("full"):
            raise CheckpointError(
                "--resume: the checkpoint is a LoRA run's (its trainer state has no full "
                "fine-tune's weights): resume it with --finetuning-type lora"
            )
        try:
            self.engine.load_state_dict(state)
        except ValueError as e:
            raise CheckpointError(f"--resume: {e}; resume with the model it trained") from None
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return self.engine.step_count

    def restore_latest_checkpoint(self, output: str):
        """Trainer's, and with no checkpoint the base model's weights put back into the
        store's home (a trainer that died before the first checkpoint had updated them)."""
        found = super().restore_latest_checkpoint(output)
        if found is None:
            self._base_weights()
        return found

    def _base_weights(self) -> None:
        base = self._base_dir()
        args = hf_checkpoint.read_model_args(base)
        ckpt = hf_checkpoint.SafetensorsCheckpoint(base)
        named = dict(hf_checkpoint.read_globals(ckpt, args, torch.float32))
        for i in range(args.num_layers):
            block = hf_checkpoint.read_block(ckpt, args, i, torch.float32)
            named.update({f"model.layers.{i}.{k}": v for k, v in block.items()})
        self.engine.load_weights(named)

    def info(self) -> dict:
        out = super().info()
        out["trained_parameters"] = self.engine.host.num_parameters() if self.engine else 0
        return out
