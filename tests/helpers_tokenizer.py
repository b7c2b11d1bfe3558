"""A tiny real tokenizer for tests: a WordLevel model trained on generated sentences.

Every word of `WORDS` is one token, so a test can reason about token counts exactly; the
post-processor prepends BOS the way Llama's tokenizer.json does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

WORDS = (
    "the a cat dog sat on mat ran far away big small red blue green tree house river "
    "stone bird sang loud quiet night day sun moon star wind rain snow fast slow"
).split()


def sentences(n: int, seed: int = 0, min_words: int = 1, max_words: int = 12) -> list[str]:
    """`n` deterministic sentences made of `WORDS` (lengths in [min_words, max_words])."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


def make_tokenizer(directory: str | Path) -> tuple[str, int, int, int]:
    """Train and save `directory/tokenizer.json`; returns (path, bos_id, eos_id, pad_id)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Special tokens come first, in this order, so their ids are 0..3.
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, BOS, EOS, UNK], min_frequency=1)
    tok.train_from_iterator([" ".join(WORDS)] + sentences(50), trainer=trainer)
    bos_id, eos_id, pad_id = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    path = Path(directory) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path), bos_id, eos_id, pad_id


IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLE_WORDS = ["system", "user", "assistant", "tool"]

# A ChatML-like template (as Qwen's and many fine-tunes' are), with the BOS a Llama-3 template
# puts first: each turn is `<|im_start|>ROLE\nCONTENT<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_chat_tokenizer(directory: str | Path, template: str | None = CHAT_TEMPLATE) -> dict:
    """The test tokenizer plus `<|im_start|>`/`<|im_end|>` (special) and the role words (appended
    after the base vocabulary, so every other id is unchanged), and a tokenizer_config.json that
    holds `template` (None: no chat_template key). Returns the ids of the added tokens."""
    path, bos_id, eos_id, pad_id = make_tokenizer(directory)
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens([IM_START, IM_END])
    tok.add_tokens(ROLE_WORDS)
    tok.save(path)
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    if template is not None:
        config["chat_template"] = template
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))
    return {t: tok.token_to_id(t) for t in [IM_START, IM_END, *ROLE_WORDS]}


# A "### Role: text" template whose generation prompt ends with a space, as Llama-2-era and many
# fine-tunes' templates do: a subword tokenizer joins that space to the answer's first word.
SPACE_PROMPT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}### Assistant: {{ m['content'] }}</s>\n"
    "{% else %}### {{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant: {% endif %}"
)


def make_subword_chat_tokenizer(directory: str | Path, kind: str) -> None:
    """A small BPE tokenizer whose tokens carry the space before a word, as real models' do:
    `kind` "byte-level" (GPT-2, Llama 3, Qwen: `Ġword`) or "metaspace" (SentencePiece, Llama 2,
    Mistral: `▁word`), trained on `SPACE_PROMPT_TEMPLATE` conversations, with `</s>` special; and
    a tokenizer_config.json holding that template. Writes `directory/tokenizer.json`."""
    tok = Tokenizer(models.BPE(unk_token=None if kind == "byte-level" else UNK))
    if kind == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte: any text encodes
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        alphabet = []
    else:
        raise ValueError(kind)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[PAD, BOS, EOS, UNK], initial_alphabet=alphabet
    )
    said = sentences(400)
    corpus = [
        f"### user: {a}\n### Assistant: {b}{EOS}\n"
        for a, b in zip(said[::2], said[1::2], strict=True)
    ]
    tok.train_from_iterator(corpus, trainer=trainer)
    path = Path(directory) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": SPACE_PROMPT_TEMPLATE}
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))
