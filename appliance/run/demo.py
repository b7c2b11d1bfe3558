"""The built-in demo: a tiny Llama-shaped model and a corpus with learnable structure, made on the
fly in a temp dir (nothing downloaded), so `appliance train` with no arguments shows the whole
pipeline training for real in a few minutes on a CPU. Its run settings (steps, seq_len, lr, ...)
are `config.DEMO_SETTINGS`, a layer of the config below the config file and the flags.

The model is written exactly as a Hugging Face checkpoint would be (config.json, model.safetensors,
tokenizer.json) with random weights, so the demo exercises the same loading path as a real model.
The corpus is sentences from a small grammar in which each subject fixes its adjective, verb and
object: a model that learns the grammar predicts most tokens, one that does not cannot.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
SUBJECTS = {
    # subject: (adjective, verb, object) — the structure the adapter has to learn
    "cat": ("small", "sleeps", "mat"),
    "dog": ("loud", "chases", "ball"),
    "bird": ("blue", "sings", "tree"),
    "fish": ("quick", "swims", "river"),
    "horse": ("brown", "runs", "field"),
    "owl": ("wise", "watches", "moon"),
    "bee": ("busy", "visits", "flower"),
    "fox": ("red", "hunts", "forest"),
}
PLACES = ["near", "under", "beside", "behind"]
COUNT = "one two three four five six seven eight nine ten".split()

DEMO_MODEL = dict(
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def sentence(rng: random.Random) -> str:
    if rng.random() < 0.25:  # counting runs: a second kind of structure
        start = rng.randrange(0, 5)
        return "count " + " ".join(COUNT[start : start + rng.randint(3, 6)]) + " ."
    subject = rng.choice(list(SUBJECTS))
    adj, verb, obj = SUBJECTS[subject]
    return f"the {adj} {subject} {verb} {rng.choice(PLACES)} the {obj} ."


def write_corpus(path: Path, documents: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(documents):
            text = " ".join(sentence(rng) for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_tokenizer(model_dir: Path) -> Tokenizer:
    words = sorted(
        {w for s in SUBJECTS for w in (s, *SUBJECTS[s])}
        | set(PLACES)
        | set(COUNT)
        | {"the", "count", "."}
    )
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(model_dir / "tokenizer.json"))
    return tok


def write_model(model_dir: Path, vocab_size: int, seed: int) -> None:
    """A random Llama checkpoint in Hugging Face's layout (std 0.02 init, unit norms)."""
    c = DEMO_MODEL
    H, inter, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hs = H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hs
    g = torch.Generator().manual_seed(seed)

    def init(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab_size, H, generator=g),
        "model.norm.weight": torch.ones(H),
        # a frozen random head needs room for confident logits: rows of norm ≈ 2
        "lm_head.weight": torch.randn(vocab_size, H, generator=g) * (2 / H**0.5),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(H),
                p + "post_attention_layernorm.weight": torch.ones(H),
                p + "self_attn.q_proj.weight": init(H, H),
                p + "self_attn.k_proj.weight": init(kv, H),
                p + "self_attn.v_proj.weight": init(kv, H),
                p + "self_attn.o_proj.weight": init(H, H),
                p + "mlp.gate_proj.weight": init(inter, H),
                p + "mlp.up_proj.weight": init(inter, H),
                p + "mlp.down_proj.weight": init(H, inter),
            }
        )
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **c,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def make_demo(root: str | Path, seed: int = 0) -> dict[str, str]:
    """Create the demo model, training corpus and held-out eval corpus under `root`."""
    root = Path(root)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(model_dir)
    write_model(model_dir, tok.get_vocab_size(), seed)
    train = write_corpus(root / "train.jsonl", documents=2000, seed=seed + 1)
    held_out = write_corpus(root / "eval.jsonl", documents=64, seed=seed + 2)
    return {
        "model": str(model_dir),
        "data": str(train),
        "eval_data": str(held_out),
        "output": str(root / "output"),
    }
