"""FullTrainer: a Trainer (actors/trainer.py) whose engine trains every weight
(engine/full.py), and whose output is the whole model in the Hugging Face layout.

What it writes (actors/full_files.py), in a checkpoint and at the end of a run: the model as
`AutoModelForCausalLM.from_pretrained` loads it (under `model/` in a checkpoint, at the top of
--output at the end), each weight shard streamed from the host weights as it is written; in a
checkpoint, beside it, the fp32 master weights and AdamW moments a part at a time
(`optimizer/<part>.pt`) and a small `trainer_state.pt` (step, RNG, part names), so a resume
continues the exact run in any compute dtype. A restore reads the parts one at a time too (each
checked against the manifest as it is read), and never the model's shards.

Its weights live in the weight store's writable home (actors/weight_home.py), which outlives a
trainer: a recreated trainer puts the checkpoint's weights back into it, or, when the run has
no checkpoint yet, the base model's (read again from its files).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from appliance.actors.full_files import (
    HF_CONFIG,
    INDEX,
    MODEL_DIR,
    OPTIMIZER_DIR,
    SHARD_BYTES,
    model_files,
    part_file,
    torch_bytes,
    written_files,
)
from appliance.actors.trainer import BIG_FILES, TRAINER_STATE, Trainer, UntrustedState
from appliance.engine.full import FullFinetuneEngine
from appliance.errors import first_line
from appliance.models import hf_checkpoint
from appliance.storage import uri as storage
from appliance.storage.checkpoints import (
    CheckpointError,
    FileData,
    load_latest_checkpoint,
    read_file,
    write_file,
)
from appliance.storage.localize import localize_model

__all__ = ["INDEX", "FullTrainer", "written_files"]


class FullTrainer(Trainer):
    """A data-parallel rank that trains every weight (settings.finetuning_type == "full")."""

    shard_bytes = SHARD_BYTES

    def _make_engine(self, group) -> FullFinetuneEngine:
        options = self._engine_options(group)
        return FullFinetuneEngine(
            self.source, freeze_embeddings=self.settings.freeze_embeddings, **options
        )

    def _big(self, name: str) -> bool:
        return name in BIG_FILES or name.startswith((f"{MODEL_DIR}/", f"{OPTIMIZER_DIR}/"))

    # ------------------------------------------------------------ the files

    def model_files(self) -> dict[str, FileData]:
        """The trained model as file name → bytes or Stream (actors/full_files.py)."""
        weights = self.engine.named_weights()
        return model_files(weights, self.shard_bytes, self._base_dir(), self.settings.dtype)

    def _base_dir(self) -> Path:
        return Path(localize_model(self.settings.model))

    def adapter_files(self) -> dict[str, FileData]:
        """What a checkpoint holds besides trainer_state.pt: the model under model/, and each
        part's masters and moments, serialised only when its file is written."""
        files = {f"{MODEL_DIR}/{k}": v for k, v in self.model_files().items()}
        for part in self.engine.host.master:
            files[part_file(part)] = self._part_stream(part)
        return files

    def _part_stream(self, part: str):
        return lambda: [torch_bytes(self.engine.part_state(part))]

    def write_adapter(self, output: str) -> None:
        """Publish the trained model at the top of `output`: every file, config.json last (a
        directory with config.json beside its weights is a complete model)."""
        files = self.model_files()
        config_uri = storage.join(output, HF_CONFIG)
        if storage.exists(config_uri):
            storage.delete(config_uri)
        for name in sorted(files):
            if name != HF_CONFIG:
                write_file(storage.join(output, name), files[name])
        storage.write_bytes(config_uri, files[HF_CONFIG])

    # ------------------------------------------------------------ state

    def state_bytes(self) -> bytes:
        """trainer_state.pt: the step, the RNG and the names of the parts whose files hold the
        masters and moments (adapter_files)."""
        rng = {"rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        parts = list(self.engine.host.master)
        return bytes(
            torch_bytes({"full": True, **rng, "step": self.engine.step_count, "parts": parts})
        )

    def part_bytes(self) -> list[bytes]:
        """Each part's file, in state_bytes' order (what a checkpoint writes, all at once)."""
        return [bytes(torch_bytes(self.engine.part_state(p))) for p in self.engine.host.master]

    def load_state_bytes(self, data: Any) -> int:
        """Restore a checkpoint's state: `data` is [trainer_state.pt, then each part's file in
        the order it names them], as bytes or object refs of them (rank 0 sends the other ranks
        refs, fetched one at a time here)."""
        items = data if isinstance(data, list) else [data]
        state = self._small_state(_fetched(items[0]))
        if "host_adamw" in state:  # a checkpoint that holds every part in this one file
            return self._loaded(state, whole=True)
        self._check_parts(state["parts"], len(items) - 1)
        for part, item in zip(state["parts"], items[1:], strict=True):
            self._load_part(part, _fetched(item))
        return self._loaded(state)

    def restore_latest_checkpoint(self, output: str) -> dict[str, Any] | None:
        """Trainer.restore_latest_checkpoint's, reading the model's shards never and the parts'
        files one at a time (checked against the manifest as each is read; a damaged one sends
        the restore to the previous checkpoint). With no checkpoint, the base model's weights
        go back into the store's home (a trainer that died before the first checkpoint had
        updated them). The other ranks get refs of the files, put in the object store a part
        at a time."""
        import ray

        shared = self.settings.world_size > 1
        untrusted: list[str] = []
        older_than = None
        while True:
            ckpt = load_latest_checkpoint(output, only=self._read_first, older_than=older_than)
            if ckpt is None and untrusted:
                raise CheckpointError(
                    f"no usable checkpoint under {output}: " + "; ".join(untrusted), untrusted
                )
            if ckpt is None:
                self._base_weights()
                return None
            small = ckpt.files[TRAINER_STATE]
            refs = [ray.put(small)] if shared else []
            current = TRAINER_STATE  # the file being read
            try:
                state = self._small_state(small)
                if "host_adamw" in state:
                    self._loaded(state, whole=True)
                    break
                self._check_parts(state["parts"], None)
                for part in state["parts"]:
                    current = part_file(part)
                    data = read_file(ckpt, current)  # CheckpointError naming it: damaged
                    self._load_part(part, data)
                    refs += [ray.put(data)] if shared else []
                    del data
                self._loaded(state)
                break
            except UntrustedState as e:
                untrusted += [*ckpt.skipped, f"{storage.join(ckpt.uri, current)}: {e}"]
            except CheckpointError as e:
                if not e.problems:
                    raise  # another model's, or a LoRA run's: not a damaged file
                untrusted += [*ckpt.skipped, *e.problems]
            older_than = ckpt.step
        return self._restored(ckpt, untrusted, [ray.put(refs)] if shared else [])

    def _read_first(self, name: str) -> bool:
        """The files a restore reads with the checkpoint (the rest: the model, never; the
        parts, one at a time)."""
        return not name.startswith((f"{MODEL_DIR}/", f"{OPTIMIZER_DIR}/"))

    def _small_state(self, data: bytes) -> dict:
        state = _trusted(data, {"rng", "step"}, "a trainer's state (rng, step)")
        if not state.get("full"):
            raise CheckpointError(
                "--resume: the checkpoint is a LoRA run's (its trainer state has no full "
                "fine-tune's weights): resume it with --finetuning-type lora"
            )
        if "host_adamw" not in state and not isinstance(state.get("parts"), list):
            raise UntrustedState("not trusted, not loaded: it names no optimizer parts")
        return state

    def _check_parts(self, parts: list[str], given: int | None) -> None:
        mine = list(self.engine.host.master)
        if sorted(parts) != sorted(mine):
            raise CheckpointError(
                f"--resume: the optimizer state has {len(parts)} parts, this model "
                f"{len(mine)}: it is another model's; resume with the model it trained"
            )
        if given is not None and given != len(parts):
            raise CheckpointError(f"a trainer state of {len(parts)} parts came with {given}")

    def _load_part(self, part: str, data: bytes) -> None:
        state = _trusted(data, {"master", "optimizer"}, "a part's masters and moments")
        try:
            self.engine.load_part_state(part, state)
        except ValueError as e:
            raise CheckpointError(f"--resume: {e}; resume with the model it trained") from None

    def _loaded(self, state: dict, whole: bool = False) -> int:
        """The parts are back (or, `whole`, are all in `state`): the step count, the RNG."""
        if whole:
            try:
                self.engine.load_state_dict(state)
            except ValueError as e:
                raise CheckpointError(f"--resume: {e}; resume with the model it trained") from None
        else:
            self.engine.loaded_parts(state["step"])
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return self.engine.step_count

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


def _fetched(item: Any) -> bytes:
    """Bytes as they are, an object ref's fetched."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return item
    import ray

    return ray.get(item)


def _trusted(data: bytes, keys: set[str], what: str) -> dict:
    """torch.load of tensors and numbers only, a dict with `keys`; UntrustedState otherwise."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not keys <= state.keys():
            raise ValueError(f"it does not hold {what}")
    except Exception as e:  # noqa: BLE001 - whatever the file is, it is not trusted
        raise UntrustedState(
            f"not trusted, not loaded ({type(e).__name__}: {first_line(e)[:200]}): a "
            "checkpoint's trainer state holds tensors and numbers only"
        ) from None
    return state
