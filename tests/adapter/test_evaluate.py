"""`evaluate` equals the same quantity computed with transformers (+ peft) on the same records.

Tolerance: 1e-5 relative error on the loss (fp32, CPU); the token count is exact.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from tokenizers import Tokenizer

from appliance.adapter.evaluate import evaluate
from appliance.data.records import SKIP_HINT, DataError
from appliance.errors import ConfigError, ModelError
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec, LoraWeights
from tests.helpers_model import FAMILY_VARIANTS, load_hf, lora_with_random_b, make_model
from tests.helpers_tokenizer import sentences

RTOL = 1e-5


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def reference(model, tokenizer_file, texts, seq_len, eos=2) -> tuple[float, int]:
    """Summed next-token NLL / predicted tokens, one forward per record (its ids and the EOS
    training appends, truncated to seq_len), as transformers gives."""
    tok = Tokenizer.from_file(str(tokenizer_file))
    total, n = 0.0, 0
    with torch.no_grad():
        for text in texts:
            if not text.strip():  # an empty or blank text is no document: nothing to score
                continue
            ids = torch.tensor([(tok.encode(text, add_special_tokens=True).ids + [eos])[:seq_len]])
            if ids.shape[1] < 2:
                continue
            logits = model(input_ids=ids).logits.float()[0]
            total += float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
    return total / n, n


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("eval") / "model", "llama-gqa-rope3-tied")


@pytest.fixture
def texts():
    # 1-word texts are 2 tokens with BOS; a long one is truncated by seq_len=10
    return sentences(23, seed=4, min_words=1, max_words=20) + ["", "cat", " ".join(["dog"] * 40)]


def test_base_model_loss_matches_transformers(model_dir, texts, tmp_path):
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])
    # batch_tokens=25: several engine calls, some records alone, the long ones truncated
    ours = evaluate(model_dir, data, seq_len=10, batch_tokens=25)
    loss, n = reference(load_hf(model_dir), model_dir / "tokenizer.json", texts, seq_len=10)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL
    # the empty text scores nothing (it is no document); the 40-word one counts seq_len - 1
    assert n == sum(min(len(t.split()) + 2, 10) - 1 for t in texts if t.strip())


def test_adapter_loss_matches_peft(model_dir, texts, tmp_path):
    lora = lora_with_random_b(read_model_args(model_dir), LoraSpec(rank=4, alpha=8.0), seed=3)
    lora.save(tmp_path / "adapter")
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])

    ours = evaluate(model_dir, data, seq_len=16, adapter_dir=tmp_path / "adapter")
    peft = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter").eval()
    loss, n = reference(peft, model_dir / "tokenizer.json", texts, seq_len=16)
    base, _ = reference(load_hf(model_dir), model_dir / "tokenizer.json", texts, seq_len=16)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL
    assert abs(loss - base) / base > 1e-3  # the adapter changes the loss: the check has teeth


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_every_family_with_an_adapter_matches_peft(variant, texts, tmp_path):
    """seq_len 24: the long records pass every sliding window and Phi-3's original length."""
    model_dir = make_model(tmp_path / "model", variant)
    lora_with_random_b(read_model_args(model_dir), LoraSpec(rank=4, alpha=8.0), seed=3).save(
        tmp_path / "adapter"
    )
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])
    ours = evaluate(model_dir, data, seq_len=24, adapter_dir=tmp_path / "adapter")
    peft = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "adapter").eval()
    loss, n = reference(peft, model_dir / "tokenizer.json", texts, seq_len=24)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL


def test_blank_lines_are_skipped_and_grouping_does_not_change_the_result(model_dir, tmp_path):
    texts = sentences(9, seed=1, min_words=3)
    path = tmp_path / "eval.jsonl"
    path.write_text("\n" + "\n\n".join(json.dumps({"text": t}) for t in texts) + "\n  \n")
    one_by_one = evaluate(model_dir, path, seq_len=32, batch_tokens=1)
    all_at_once = evaluate(model_dir, path, seq_len=32, batch_tokens=10_000)
    assert one_by_one["tokens"] == all_at_once["tokens"] == sum(len(t.split()) + 1 for t in texts)
    assert abs(one_by_one["loss"] - all_at_once["loss"]) / all_at_once["loss"] < RTOL


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "the cat"', "malformed JSON"),
        ('{"body": "the cat"}', 'no "text"'),
        ('{"text": 3}', '"text" must be a string'),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_record_names_file_and_line(model_dir, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "the cat sat"}) + "\n\n" + line + "\n")
    with pytest.raises(DataError) as e:
        evaluate(model_dir, path, seq_len=8)
    assert f"{path}:3" in str(e.value)
    assert message in str(e.value)
    assert str(e.value).endswith(f" ({SKIP_HINT})")


def test_bad_records_are_skipped_with_a_warning_that_names_them(model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "the cat sat"}\n{"text": "a\tb"}\n[1]\n{"text": "a dog"}\n')
    warnings: list[str] = []
    skipped = evaluate(model_dir, path, seq_len=8, on_bad_record="skip", warn=warnings.append)
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "the cat sat"}, {"text": "a dog"}])
    assert skipped == evaluate(model_dir, good, seq_len=8)
    assert warnings == [
        f"--on-bad-record skip left out 2 bad record(s) of {path}; all 2:\n"
        f"  {path}:2: malformed JSON: Invalid control character at column 12 (a tab or other "
        "control character inside a string must be escaped: \\t)\n"
        f"  {path}:3: expected a JSON object, found an array"
    ]


def test_documents_cut_to_seq_len_are_warned_about(model_dir, tmp_path):
    """A .txt file is one document: scored on its first --seq-len tokens only, and said so."""
    path = tmp_path / "plain.txt"
    path.write_text(" ".join(sentences(10, seed=2, min_words=5, max_words=10)))
    n = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(path.read_text()).ids)
    warnings: list[str] = []
    result = evaluate(model_dir, path, seq_len=16, warn=warnings.append)
    assert result["tokens"] == 15
    assert warnings == [
        f"--seq-len 16 cut 1 of 1 document(s) of {path}, so {n + 1 - 16:,} of their {n + 1:,} "
        f"tokens are not scored (the longest has {n + 1:,}): pass a larger --seq-len, or split "
        "long documents into several records (a .txt file is one document)"
    ]  # n + 1: the EOS
    evaluate(model_dir, path, seq_len=n + 1, warn=warnings.append)  # nothing cut: no warning
    assert len(warnings) == 1


def test_a_tokenizer_with_ids_past_the_model_vocabulary_is_refused(tmp_path, texts):
    model = make_model(tmp_path / "model", "llama-mha", vocab_size=20)  # the tokenizer has ~38
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])
    with pytest.raises(DataError) as e:
        evaluate(model, data, seq_len=16)
    assert f"{model / 'tokenizer.json'} gives token ids up to " in str(e.value)
    assert f"{model / 'config.json'} has vocab_size 20" in str(e.value)


def test_bad_arguments_and_empty_data(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        evaluate(model_dir, tmp_path / "missing.jsonl", seq_len=8)
    data = write_jsonl(tmp_path / "one.jsonl", [{"text": "the cat"}])
    with pytest.raises(ConfigError, match="--seq-len must be ≥ 2"):
        evaluate(model_dir, data, seq_len=1)
    # truncated to 2 tokens, the prompt leaves no target
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": "the cat sat", "completion": "a"}])
    with pytest.raises(DataError, match="no record has a target token"):
        evaluate(model_dir, short, seq_len=2)
    with pytest.raises(ModelError, match="does not exist"):
        evaluate(tmp_path / "nope", data, seq_len=8)


def test_adapter_for_another_model_is_refused(model_dir, tmp_path):
    other = make_model(tmp_path / "other", "llama-mha", hidden_size=32, intermediate_size=48)
    LoraWeights(read_model_args(other), LoraSpec(rank=2)).save(tmp_path / "adapter")
    data = write_jsonl(tmp_path / "one.jsonl", [{"text": "the cat"}])
    with pytest.raises(ModelError, match="rank or model mismatch"):
        evaluate(model_dir, data, seq_len=8, adapter_dir=tmp_path / "adapter")


def test_eval_runs_where_ray_and_boto3_are_not_installed(model_dir, texts, tmp_path):
    """The GPU image has neither Ray nor boto3: `evaluate` (the weight store kept in-process,
    quantized on load) runs there and gives the loss it gives here. (The store once imported Ray
    to ask whether it was up, and failed.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])
    here = evaluate(model_dir, data, seq_len=10, base_quant="nf4")
    script = (
        "import json, sys; sys.modules['ray'] = None; sys.modules['boto3'] = None; "
        "from appliance.adapter.evaluate import evaluate; "
        f"r = evaluate({str(model_dir)!r}, {data!r}, seq_len=10, base_quant='nf4'); "
        "print(json.dumps({'loss': r['loss'], 'tokens': r['tokens']}))"
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    there = json.loads(run.stdout.strip().splitlines()[-1])
    assert there == {"loss": here["loss"], "tokens": here["tokens"]}


MERGE_FIRST = "merge the adapter into its base model with PEFT first (merge_and_unload)"


def peft_adapter(model_dir, out, seed=1, **config):
    """An adapter saved by PEFT itself (LoraConfig(r=4, lora_alpha=8, **config)), B non-zero."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_hf(model_dir), LoraConfig(r=4, lora_alpha=8, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """Few modules: PEFT writes "all-linear" as full module names (from 20 on, as suffixes)."""
    return make_model(tmp_path_factory.mktemp("eval") / "model", "llama-mha", num_hidden_layers=2)


def test_an_all_linear_peft_adapter_scores_as_peft_does(two_layers, texts, tmp_path):
    """Current PEFT writes target_modules="all-linear" as every module's full name
    (`model.layers.0.self_attn.q_proj`); PEFT matches names by suffix, and so does the loader."""
    model_dir = two_layers
    adapter = peft_adapter(model_dir, tmp_path / "all", target_modules="all-linear")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.down_proj" in config["target_modules"]  # the case at hand
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])

    ours = evaluate(model_dir, data, seq_len=16, adapter_dir=adapter)
    peft = PeftModel.from_pretrained(load_hf(model_dir), adapter).eval()
    loss, n = reference(peft, model_dir / "tokenizer.json", texts, seq_len=16)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL
    assert abs(loss - evaluate(model_dir, data, seq_len=16)["loss"]) / loss > 10 * RTOL  # teeth
    # the same tensors with the projections listed by their short names: the same loss
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "adapter_model.safetensors").write_bytes(
        (adapter / "adapter_model.safetensors").read_bytes()
    )
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    (listed / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": projections})
    )
    assert evaluate(model_dir, data, seq_len=16, adapter_dir=listed) == ours


def eval_refusal(model_dir, adapter, tmp_path, **config) -> str:
    """The ModelError eval of `adapter` raises, with `config` written over its
    adapter_config.json's keys first."""
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    data = write_jsonl(tmp_path / "one.jsonl", [{"text": "the cat"}])
    with pytest.raises(ModelError) as e:
        evaluate(model_dir, data, seq_len=8, adapter_dir=adapter)
    return str(e.value)


def test_full_module_names_on_some_layers_only_are_refused_as_layers_to_transform(
    two_layers, tmp_path
):
    model_dir = two_layers
    adapter = peft_adapter(model_dir, tmp_path / "all", target_modules="all-linear")
    layer_1 = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert eval_refusal(model_dir, adapter, tmp_path, target_modules=layer_1) == (
        f"{adapter}/adapter_config.json: target_modules adapts self_attn.q_proj in some layers "
        "only (not in model.layers.0), as layers_to_transform does, which is not supported: "
        f"{MERGE_FIRST}"
    )
    # names no block of this model has (an adapter for a deeper model): named, a few of them
    deeper = [f"model.layers.{i}.self_attn.q_proj" for i in range(6)]
    assert eval_refusal(model_dir, adapter, tmp_path, target_modules=deeper) == (
        f"{adapter}/adapter_config.json: target modules model.layers.2.self_attn.q_proj, "
        "model.layers.3.self_attn.q_proj, model.layers.4.self_attn.q_proj and 1 more are not in "
        "this model's blocks (model.layers.0 to model.layers.1): not supported"
    )


def test_unsupported_target_modules_are_named_a_few_at_a_time(model_dir, tmp_path):
    adapter = peft_adapter(model_dir, tmp_path / "a", target_modules=["q_proj"])
    names = [f"model.layers.{i}.mlp.fc{j}" for i in range(2) for j in (1, 2)]
    assert eval_refusal(model_dir, adapter, tmp_path, target_modules=names) == (
        f"{adapter}/adapter_config.json: target modules model.layers.0.mlp.fc1, "
        "model.layers.0.mlp.fc2, model.layers.1.mlp.fc1 and 1 more are not supported (supported: "
        "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj, "
        "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, shared_expert.gate_proj, "
        "shared_expert.up_proj, shared_expert.down_proj)"
    )


@pytest.mark.parametrize(
    "config, feature",
    [
        ({"use_dora": True}, "use_dora=true"),
        ({"use_rslora": True}, "use_rslora=true"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save (lm_head)"),
        ({"layers_to_transform": [1]}, "layers_to_transform"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
    ],
)
def test_peft_features_the_loader_lacks_are_refused_by_name(model_dir, tmp_path, config, feature):
    """Named from adapter_config.json, not by a tensor they add or leave out (DoRA's magnitude
    vectors, modules_to_save's lm_head copy, layers_to_transform's missing layers)."""
    adapter = peft_adapter(model_dir, tmp_path / "a", target_modules=["q_proj", "v_proj"], **config)
    assert eval_refusal(model_dir, adapter, tmp_path) == (
        f"{adapter}/adapter_config.json: {feature} is not supported: {MERGE_FIRST}"
    )


def test_a_tied_config_with_a_head_of_its_own_in_the_files_scores_as_transformers(texts, tmp_path):
    """config.json ties the LM head to the embeddings but the files hold another head (a
    fine-tune that trained its head and kept the config): transformers computes with the files'
    head, and so does the merged export; appliance used the embeddings, and scored (and trained)
    another model without a word."""
    from safetensors.torch import load_file, save_file

    model = make_model(tmp_path / "m", "llama-gqa-rope3-tied")
    weights = load_file(model / "model.safetensors")
    torch.manual_seed(5)
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in texts])
    ours = evaluate(model, data, seq_len=10, batch_tokens=25)
    loss, n = reference(load_hf(model), model / "tokenizer.json", texts, seq_len=10)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL
    tied = evaluate(make_model(tmp_path / "t", "llama-gqa-rope3-tied"), data, seq_len=10)
    assert abs(tied["loss"] - loss) / loss > 0.01  # the embeddings as head: another model
