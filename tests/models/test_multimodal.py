"""The language model of an image-text checkpoint (Gemma 3 from 4B up, Mistral Small 3.1), trained
as a text model (appliance/models/multimodal.py). Its numerics against transformers + peft on the
whole multimodal model are proven with every family's (FAMILY_VARIANTS: gemma3-vlm,
mistral3-vlm); here: the released configs, both tensor layouts, the LM head, export, the chat
template beside a processor, and a fine-tune end to end."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from appliance import models
from appliance.actors.weight_store import local_source
from appliance.adapter import export as E
from appliance.data.chat import ChatError, load_chat_template
from appliance.errors import ModelError
from appliance.models import multimodal
from appliance.models.hf_checkpoint import (
    SafetensorsCheckpoint,
    expected_shapes,
    read_block,
    read_globals,
    read_model_args,
    tensor_locations,
)
from appliance.models.lora import LoraSpec, read_spec
from tests.adapter.test_export import check_export_matches_peft
from tests.helpers_model import load_hf, lora_with_random_b, make_model

# config.json as the released checkpoints have it (transformers 4.50 wrote them: text_config holds
# only what differs from the text config class's defaults), vision_config shortened
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27},
}
MISTRAL_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "vocab_size": 131072,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"model_type": "pixtral", "head_dim": 64, "hidden_size": 1024},
    "vision_feature_layer": -1,
}


def _defaults_of(config_class) -> dict:
    """A text config class's defaults, under the keys TEXT_DEFAULTS uses."""
    d = config_class().to_dict()
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: per layer type
        d["rope_theta"] = rope["full_attention"]["rope_theta"]
        d["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        d["sliding_window_pattern"] = d["_sliding_window_pattern"]
    elif rope:
        d["rope_theta"] = rope["rope_theta"]
    return d


@pytest.mark.parametrize(
    "arch, config_class",
    [
        ("Gemma3ForConditionalGeneration", transformers.Gemma3TextConfig),
        ("Mistral3ForConditionalGeneration", transformers.MistralConfig),
    ],
)
def test_the_text_defaults_are_transformers_own(arch, config_class):
    _, defaults = multimodal.TEXT_DEFAULTS[arch]
    theirs = _defaults_of(config_class)
    assert {k: theirs[k] for k in defaults} == defaults


@pytest.mark.parametrize("released", [GEMMA3_4B_IT, MISTRAL_SMALL_31], ids=["gemma3", "mistral3"])
def test_a_released_config_reads_as_transformers_reads_its_text_config(released, tmp_path):
    """config.json alone (as `appliance plan` reads it): the sparse text_config filled in with the
    text class's defaults, every number the engine uses equal to transformers' reading."""
    (tmp_path / "config.json").write_text(json.dumps(released))
    args = read_model_args(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert args.language_model_of == released["architectures"][0]
    assert args.architecture == multimodal.TEXT_DEFAULTS[args.language_model_of][0]
    assert (args.vocab_size, args.hidden_size, args.intermediate_size, args.num_layers) == (
        text.vocab_size,
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
    )
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert args.rms_norm_eps == text.rms_norm_eps
    assert args.max_position_embeddings == text.max_position_embeddings
    assert args.sliding_window == text.sliding_window
    rope = text.rope_parameters
    if args.language_model_of.startswith("Gemma3"):
        assert args.layer_types == tuple(text.layer_types)
        assert args.rope_theta == rope["full_attention"]["rope_theta"]
        assert args.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        assert dict(args.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
        assert args.attn_scale == text.query_pre_attn_scalar**-0.5
        assert args.tie_word_embeddings  # no weights here: the flags (and Gemma 3 ties)
    else:
        assert args.rope_theta == rope["rope_theta"] == 1e9
        assert not args.tie_word_embeddings and "lm_head.weight" in expected_shapes(args)


def _resave_in_the_module_layout(src, dst):
    """The same checkpoint with its tensors under the multimodal model's module names
    (`model.language_model.…`, `model.vision_tower.…`, `lm_head.weight`): transformers ≥ 4.52's."""
    import shutil

    shutil.copytree(src, dst)
    renamed = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model.") :]
        else:
            name = "model." + name
        renamed[name] = t
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("variant", ["gemma3-vlm", "mistral3-vlm"])
def test_either_tensor_layout_reads_the_same_weights(variant, tmp_path):
    src = make_model(tmp_path / "released", variant, with_tokenizer=False)
    modules = _resave_in_the_module_layout(src, tmp_path / "modules")
    args = read_model_args(src)
    assert read_model_args(modules) == args
    a, b = SafetensorsCheckpoint(src), SafetensorsCheckpoint(modules)
    a.check(args), b.check(args)
    assert set(tensor_locations(a)) == set(a.files) and "model.norm.weight" in a.files
    for x, y in [(read_globals(a, args, torch.float32), read_globals(b, args, torch.float32))] + [
        (read_block(a, args, i, torch.float32), read_block(b, args, i, torch.float32))
        for i in range(args.num_layers)
    ]:
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # the weight store (what the trainers stream from) reads the language model alone
    store = local_source(modules, "float32")
    assert store.num_blocks == args.num_layers
    assert set(store.globals()) == set(read_globals(a, args, torch.float32))
    assert ("lm_head.weight" in store.globals()) == (variant == "mistral3-vlm")

    # a missing tensor is named as the files would hold it, in either layout
    for ckpt, prefix in [(src, "language_model.model."), (modules, "model.language_model.")]:
        tensors = load_file(ckpt / "model.safetensors")
        del tensors[prefix + "layers.1.mlp.up_proj.weight"]
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelError) as e:
            SafetensorsCheckpoint(ckpt).check(args)
        want = (
            f"{ckpt}: tensor '{prefix}layers.1.mlp.up_proj.weight' is missing from the checkpoint"
        )
        assert str(e.value) == want
        with pytest.raises(ModelError, match=re.escape(want)):
            SafetensorsCheckpoint(ckpt).read(["model.layers.1.mlp.up_proj.weight"], None)


def test_the_lm_head_is_the_files_own_whatever_the_flags_say(tmp_path):
    """transformers ≥ 5 writes the outer tie_word_embeddings=true of Mistral3Config's defaults
    into every config it saves, and does not tie an LM head the files hold: neither do we."""
    model_dir = make_model(tmp_path / "m", "mistral3-vlm", with_tokenizer=False)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(cfg))
    args = read_model_args(model_dir)
    assert not args.tie_word_embeddings and "lm_head.weight" in expected_shapes(args)
    hf = load_hf(model_dir)
    assert hf.lm_head.weight.data_ptr() != hf.get_input_embeddings().weight.data_ptr()


def test_other_image_text_models_are_refused_by_name(tmp_path):
    cfg = {**MISTRAL_SMALL_31, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        read_model_args(tmp_path)
    assert (
        "architecture ['Qwen2_5_VLForConditionalGeneration'] has a vision tower; supported are "
        "text-only causal LMs and the language model of Gemma3ForConditionalGeneration and "
        "Mistral3ForConditionalGeneration"
    ) in str(e.value)


def test_the_adapter_names_the_language_model_only_and_reads_back(tmp_path):
    args = read_model_args(make_model(tmp_path / "m", "gemma3-vlm", with_tokenizer=False))
    lora = lora_with_random_b(args, LoraSpec(rank=2, alpha=4.0, targets=("q", "v", "down")))
    lora.save(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == r".*language_model.*\.(down_proj|q_proj|v_proj)"
    assert read_spec(tmp_path / "adapter").targets == ("q", "v", "down")
    config["target_modules"] = r".*\.(q_proj|v_proj)"  # someone else's pattern: not guessed at
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="target_modules as a regex is not supported"):
        read_spec(tmp_path / "adapter")


@pytest.mark.parametrize("variant", ["gemma3-vlm", "mistral3-vlm"])
def test_export_keeps_the_vision_tower_every_name_and_every_file(variant, tmp_path):
    model_dir = make_model(tmp_path / "model", variant)
    extra = {
        "chat_template.json": '{"chat_template": "{{ messages }}"}',
        "preprocessor_config.json": '{"image_processor_type": "SiglipImageProcessor"}',
        "LICENSE": "the licence",
    }
    for name, text in extra.items():
        (model_dir / name).write_text(text)
    args = read_model_args(model_dir)
    lora_with_random_b(args, LoraSpec(rank=2, alpha=4.0)).save(tmp_path / "adapter")
    out = E.export_merged(model_dir, tmp_path / "adapter", tmp_path / "out", max_shard_bytes=40_000)

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        before = {n: f.get_tensor(n) for n in f.keys()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(before)  # the files' own names, the vision tower's too
    after = {}
    for shard in set(index["weight_map"].values()):
        after.update(load_file(out / shard))
    adapted = tuple(models.linear_weight_names(args))  # the 7 projections LoRA targets here
    for name, t in before.items():
        changed = name.startswith("language_model.model.layers.") and name.endswith(adapted)
        assert torch.equal(after[name], t) != changed, name
    for name in ["config.json", "tokenizer.json", *extra]:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    _, info = getattr(transformers, args.language_model_of).from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    check_export_matches_peft(model_dir, tmp_path / "adapter", out)
    card = ModelCard.load(out / "README.md")  # what the card says loads it: the model's own class
    assert card.data.pipeline_tag == "image-text-to-text"
    assert f"model = {args.language_model_of}.from_pretrained(" in card.text


def test_a_processors_chat_template_json_is_the_models_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.json").write_text('{"chat_template": "{{ eos_token }}"}')
    chat = load_chat_template(tmp_path)
    assert chat.source == f"{tmp_path / 'chat_template.json'} chat_template"
    assert chat.render([], False) == "</s>"
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "tok"}')  # it wins
    assert load_chat_template(tmp_path).template == "tok"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.json").write_text('{"chat_template": ')
    with pytest.raises(ChatError, match=r"cannot read .*chat_template\.json"):
        load_chat_template(tmp_path)


@pytest.mark.integration
def test_a_chat_fine_tune_of_a_multimodal_model_end_to_end(ray_local, tmp_path):
    """`appliance train` on an image-text checkpoint whose chat template is its processor's: the
    held-out assistant loss drops, and the run's adapter loads in PEFT on the whole model and
    adapts the language model's projections, nothing else."""
    from appliance.adapter.evaluate import evaluate
    from appliance.run.driver import train
    from appliance.run.progress import Progress
    from tests.e2e.test_chat_train_e2e import conversations
    from tests.helpers_model import tiny_train_config
    from tests.helpers_tokenizer import make_chat_tokenizer

    model_dir = make_model(tmp_path / "model", "mistral3-vlm", initializer_range=0.1)
    make_chat_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    data, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(120, seed=1)))
    held_out.write_text("".join(json.dumps(c) + "\n" for c in conversations(16, seed=2)))
    out = tmp_path / "out"
    cfg = tiny_train_config(model_dir, data, out, steps=20, seq_len=64)
    train(cfg, Progress("json", stream=io.StringIO()))

    before = evaluate(model_dir, held_out, seq_len=64)["loss"]
    after = evaluate(model_dir, held_out, seq_len=64, adapter_dir=out)["loss"]
    assert after < 0.5 * before, (before, after)
    peft = PeftModel.from_pretrained(load_hf(model_dir), out)
    lora_keys = [n for n, _ in peft.named_parameters() if "lora_" in n]
    assert lora_keys and all(".language_model." in n for n in lora_keys)
    assert len(lora_keys) == 2 * 7 * 3  # A and B of the 7 projections of 3 blocks, nothing else
    card = (out / "README.md").read_text()  # its card loads it that way, and names the pattern
    assert "model = Mistral3ForConditionalGeneration.from_pretrained(" in card
    pattern = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    escaped = pattern.replace("|", "\\|")  # in a table cell, as Markdown wants it
    assert f", on `{escaped}` |" in card
