"""LoRA adapters: fp32 parameters per block, and reading/writing them in PEFT's format.

A LoRA module adds `B @ A @ dropout(x) * alpha / rank` to a frozen linear layer, with A (rank, in)
and B (out, rank). PEFT's initialisation (A Kaiming-uniform, B zero) makes the adapted model start
equal to the base model. Files are `adapter_config.json` + `adapter_model.safetensors` with PEFT's
key names, so `peft.PeftModel.from_pretrained` loads them onto the transformers model unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from appliance.errors import ConfigError, ModelError
from appliance.models import (
    EXPERT_MODULES,
    TARGETS,
    block_linears,
    expert_modules,
    lora_experts,
    lora_modules,
    lora_pass,
    multimodal,
    resolve_targets,
)
from appliance.models.layers import LoraContext, ModelArgs
from appliance.models.lora_pass import BlockBuffers

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        """The modules adapted; "experts" stands for both expert tensors (EXPERT_MODULES)."""
        return lora_modules(self.targets)


def folds_scale(scale: float, dtype: torch.dtype) -> bool:
    """Whether LoraWeights.context folds `scale` into B: a power of two other than 1 (a scale of
    1 needs no multiply at all: layers.linear skips it), not in float16."""
    return dtype != torch.float16 and scale > 0 and scale != 1.0 and math.frexp(scale)[0] == 0.5


# PEFT wraps a module's targeted parameters one inside the other, in the module's parameter
# order: with both expert tensors targeted, gate_up_proj's adapter is the inner one
# (`mlp.experts.base_layer.lora_A`), down_proj's the outer (`mlp.experts.lora_A`)
_PEFT_PATHS = {
    EXPERT_MODULES[0]: "mlp.experts.base_layer",
    EXPERT_MODULES[1]: "mlp.experts",
    EXPERT_MODULES[2]: "experts.base_layer",  # Gemma 4's experts: no `mlp.` above them
    EXPERT_MODULES[3]: "experts",
}


def peft_key(block: int, module: str, which: str, layers: str = "model.layers") -> str:
    """PEFT's key for block `block`'s `module` ('self_attn.q_proj', or an expert tensor),
    which = 'A' | 'B'; `layers`: where the blocks are among the model's modules (`peft_layers`)."""
    path = _PEFT_PATHS.get(module, module)
    return f"base_model.model.{layers}.{block}.{path}.lora_{which}.weight"


def peft_layers(args: ModelArgs) -> str:
    """Where the blocks are among the transformers model's modules: `model.layers`, or a
    multimodal model's `model.language_model.layers`."""
    return multimodal.LAYERS if args.language_model_of else "model.layers"


class LoraWeights:
    """The trainable parameters: for each block, module → (A, B) as fp32 leaf tensors.

    `spec.targets` is read against the model's family (models.resolve_targets: on Phi-3 the
    default q,k,v,... adapt the fused qkv and gate_up); `self.spec` holds what they resolved to.
    """

    def __init__(
        self, args: ModelArgs, spec: LoraSpec, device: torch.device | str = "cpu", seed: int = 0
    ):
        spec = dataclasses.replace(spec, targets=resolve_targets(args, spec.targets))
        if "experts" in spec.targets and spec.dropout:
            raise ConfigError(
                f"--lora-dropout {spec.dropout}: LoRA on the experts takes no dropout (PEFT's "
                "target_parameters refuse it); give --lora-dropout 0 or leave experts out of "
                "--lora-targets"
            )
        self.args, self.spec = args, spec
        gen = torch.Generator().manual_seed(seed)
        # per block: its parameters as views of one flat fp32 buffer (models/lora_pass.py)
        self.buffers: list[BlockBuffers] = []
        for i in range(args.num_layers):
            # the targets block i has (Qwen3.5: linear-attention blocks have no q_proj, ...)
            experts = expert_modules(args)
            has = [m for m in spec.modules if m in block_linears(args, i) or m in experts]
            shapes = {}
            for module in has:
                out_f, in_f = args.module_shape(module, i)
                r = spec.rank * lora_experts(args, module)  # the experts' side by side
                shapes[module] = ((r, in_f), (out_f, r))
            n = sum(a[0] * a[1] + b[0] * b[1] for a, b in shapes.values())
            block = BlockBuffers(shapes, torch.zeros(n))  # B = 0
            for A, _ in block.params.values():
                # PEFT's default: kaiming_uniform_(a=sqrt(5)) → U(-1/sqrt(in), 1/sqrt(in))
                bound = 1.0 / math.sqrt(A.shape[1])
                A.uniform_(-bound, bound, generator=gen)
            self.buffers.append(block.to(device))
        #: per block, module → (A, B): fp32 leaves, views of the block's flat buffer
        self.blocks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            b.params for b in self.buffers
        ]

    def parameters(self) -> list[torch.Tensor]:
        return [p for block in self.blocks for ab in block.values() for p in ab]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def context(
        self,
        i: int,
        dtype: torch.dtype,
        generator: torch.Generator | None = None,
        dropout: float | None = None,
        kernels: str = "exact",
    ) -> LoraContext:
        """Block i's adapters in the compute dtype for one pass (differentiable): one copy of
        the block's flat buffer, views per module, and in the backward one add per micro-batch
        into the fp32 gradients (models/lora_pass.py).

        A scale that is a power of two (alpha 32 / rank 16: 2) is folded into B here, once per
        block, instead of multiplying every micro-batch's LoRA output: one kernel fewer per
        projection in the forward, the recompute and the backward. Exact: scaling by a power of
        two commutes with every rounding of the products and sums, so the output and every
        gradient are bitwise PEFT's. Not in float16, whose subnormals (small gradients) would
        round differently; other scales keep the multiply.

        `kernels="fast"` (without dropout, whose masks differ per projection): the A's of the
        projections that read one input (q, k, v; gate, up) as one stacked matmul
        (LoraContext.stacked). Not bitwise; held to the fast tier's rule (docs/architecture.md)."""
        scale = self.spec.scale
        fold = folds_scale(scale, dtype)
        p = self.spec.dropout if dropout is None else dropout
        block = self.buffers[i]
        if not block.names:  # nothing adapted in this block
            return LoraContext({}, scale, p, generator)
        stack = kernels == "fast" and p == 0
        weights, stacked = lora_pass.gather(block, dtype, scale if fold else None, stack)
        return LoraContext(weights, 1.0 if fold else scale, p, generator, stacked=stacked or None)

    # ------------------------------------------------------------ PEFT format

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT key → fp32 CPU copy (a snapshot: later steps do not change it)."""
        out = {}
        for i, block in enumerate(self.blocks):
            for module, (A, B) in block.items():
                for which, p in (("A", A), ("B", B)):
                    key = peft_key(i, module, which, peft_layers(self.args))
                    out[key] = p.detach().to("cpu", torch.float32, copy=True)
        return out

    def load_peft_state_dict(self, sd: dict[str, torch.Tensor], where: str = "adapter") -> None:
        expected = set()
        with torch.no_grad():
            for i, block in enumerate(self.blocks):
                for module, (A, B) in block.items():
                    for which, p in (("A", A), ("B", B)):
                        key = peft_key(i, module, which, peft_layers(self.args))
                        expected.add(key)
                        if key not in sd:
                            raise ModelError(f"{where}: missing LoRA tensor {key}")
                        if tuple(sd[key].shape) != tuple(p.shape):
                            raise ModelError(
                                f"{where}: {key} has shape {tuple(sd[key].shape)}, expected "
                                f"{tuple(p.shape)} (rank or model mismatch)"
                            )
                        p.copy_(sd[key])
        extra = sorted(set(sd) - expected)
        if extra:
            raise ModelError(f"{where}: unexpected LoRA tensors, e.g. {extra[0]}")

    def save(self, out_dir: str | Path, base_model: str = "") -> None:
        """Write adapter_model.safetensors then adapter_config.json (the config marks completion)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(self.peft_state_dict(), out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (out_dir / ADAPTER_CONFIG).write_text(
            json.dumps(adapter_config(self.spec, self.args, base_model), indent=2)
        )


def adapter_config(
    spec: LoraSpec, args: ModelArgs, base_model: str = "", revision: str | None = None
) -> dict:
    """PEFT's adapter_config.json. On a multimodal model `target_modules` is a pattern that
    matches the language model's projections only (the vision tower has modules of those names).
    `base_model` is a Hub id (with the snapshot's commit as `revision`) for a model from the
    Hugging Face cache, as PEFT writes it for a model loaded by id, or the model's path."""
    names = sorted(peft_name(m) for m in spec.modules if m not in EXPERT_MODULES)
    targets = multimodal.target_pattern(names) if args.language_model_of else names
    experts = sorted(m for m in spec.modules if m in expert_modules(args))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        # the experts' tensors (LoRA on "experts"), as PEFT writes them
        **({"target_parameters": experts} if experts else {}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }


def peft_name(module: str) -> str:
    """The name `target_modules` gives a module: its own (`q_proj`), or with its parent where
    the own name is another target's too (`shared_expert.gate_proj`, not the MLP's `gate_proj`)."""
    return (
        module.removeprefix("mlp.") if ".shared_expert." in f".{module}" else module.split(".")[-1]
    )


_MODULE_BY_NAME = {peft_name(m): t for t, m in TARGETS.items() if t != "experts"}


def _target_of(name: str) -> str | None:
    """The target short name a `target_modules` entry names (PEFT matches by suffix), preferring
    the longest match (`mlp.shared_expert.gate_proj`: shared_gate, not gate); None: no target."""
    hits = [k for k in _MODULE_BY_NAME if name == k or name.endswith("." + k)]
    return _MODULE_BY_NAME[max(hits, key=len)] if hits else None


MERGE_FIRST = "merge the adapter into its base model with PEFT first (merge_and_unload)"


def _some(names: list[str], n: int = 3) -> str:
    """The first `n` of `names`, and how many more: an error names a few, not hundreds."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _refuse_unsupported_features(path: Path, cfg: dict) -> None:
    """PEFT options that change what the adapter computes beyond `B @ A * alpha / r` on whole
    projections of every block, refused by name before any tensor is read."""
    flags = [f"{key}=true" for key in ("use_dora", "use_rslora", "lora_bias") if cfg.get(key)]
    saved = cfg.get("modules_to_save")
    if saved:
        flags.append(f"modules_to_save ({_some(list(saved))})")
    if cfg.get("layers_to_transform") is not None:
        flags.append("layers_to_transform")
    flags += [key for key in ("rank_pattern", "alpha_pattern") if cfg.get(key)]
    if flags:
        raise ModelError(f"{path}: {flags[0]} is not supported: {MERGE_FIRST}")


def _check_every_block(path: Path, names: list[str], args: ModelArgs) -> None:
    """PEFT adapts a module whose name is a target or ends in "." + a target: `q_proj` adapts
    every block's, `model.layers.0.self_attn.q_proj` (current PEFT writes such names for
    target_modules="all-linear") block 0's only. Each projection must be adapted in every block
    of the language model (an adapter on some blocks only is what layers_to_transform makes)."""
    layers, blocks = peft_layers(args), range(args.num_layers)
    covered: dict[str, set[int]] = {}
    outside = []
    for name in names:
        module = TARGETS[_target_of(name)]
        keys = {i: f"{layers}.{i}.{module}" for i in blocks}
        hit = {i for i, key in keys.items() if key == name or key.endswith("." + name)}
        covered.setdefault(module, set()).update(hit)
        if not hit:
            outside.append(name)
    if outside:
        raise ModelError(
            f"{path}: target modules {_some(outside)} are not in this model's blocks "
            f"({layers}.0 to {layers}.{args.num_layers - 1}): not supported"
        )
    for module, hit in covered.items():
        if len(hit) < args.num_layers:
            missing = min(set(blocks) - hit)
            raise ModelError(
                f"{path}: target_modules adapts {module} in some layers only (not in "
                f"{layers}.{missing}), as layers_to_transform does, which is not supported: "
                f"{MERGE_FIRST}"
            )


def read_spec(adapter_dir: str | Path, args: ModelArgs | None = None) -> LoraSpec:
    """The LoraSpec of the adapter in `adapter_dir` (its adapter_config.json); with `args`, also
    checked to adapt every block of that model."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(
            f"{path}: no adapter_config.json; pass a directory written by appliance train (or PEFT)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read adapter config: {e}") from None
    if cfg.get("peft_type") != "LORA":
        raise ModelError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    _refuse_unsupported_features(path, cfg)
    names = cfg.get("target_modules") or []
    if isinstance(names, str):  # a pattern: only the one written for multimodal models
        names = multimodal.names_of_pattern(names)
        if names is None:
            raise ModelError(
                f"{path}: target_modules as a regex is not supported (only a list of module "
                "names, or the language-model pattern appliance train writes)"
            )
    # PEFT matches by suffix: `q_proj`, `self_attn.q_proj`, `model.layers.0.self_attn.q_proj`
    unknown = [n for n in names if _target_of(n) is None]
    if unknown:
        raise ModelError(
            f"{path}: target modules {_some(unknown)} are not supported (supported: "
            f"{', '.join(_MODULE_BY_NAME)})"
        )
    if args is not None:
        _check_every_block(path, names, args)
    named = {_target_of(n) for n in names}
    targets = tuple(t for t in TARGETS if t in named)
    parameters = cfg.get("target_parameters") or []
    if parameters:
        pairs = [sorted(EXPERT_MODULES[:2]), sorted(EXPERT_MODULES[2:])]
        wanted = sorted(expert_modules(args)) if args is not None else None
        if sorted(parameters) not in pairs or wanted not in (None, sorted(parameters)):
            both = ", ".join(wanted or EXPERT_MODULES[:2])
            raise ModelError(
                f"{path}: target_parameters {_some(list(parameters))} are not supported (only "
                f"both of {both}: LoRA on a MoE block's experts)"
            )
        targets += ("experts",)
    return LoraSpec(
        int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)), targets
    )


def load_adapter(
    adapter_dir: str | Path, args: ModelArgs, device: torch.device | str = "cpu"
) -> LoraWeights:
    spec = read_spec(adapter_dir, args)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ModelError(f"{path}: adapter weights are missing")
    try:
        sd = load_file(path)
    except Exception as e:  # safetensors raises several types for corrupt files
        raise ModelError(f"{path}: cannot read adapter weights: {e}") from None
    lora = LoraWeights(args, spec, device)
    lora.load_peft_state_dict(sd, str(path))
    return lora
