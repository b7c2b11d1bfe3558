"""`appliance generate`: a batch of prompts of different lengths, decoded layer-major with a KV
cache per block, gives transformers + PEFT's greedy tokens for each prompt alone, with every
block resident and with every block streamed through two slots and the caches in host memory;
sampling is reproducible by its seed."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel

from appliance.adapter.generate import Generator, Placement, Sampling, place
from appliance.cli.main import main
from appliance.errors import ConfigError
from appliance.models.hf_checkpoint import read_model_args
from tests.helpers_model import load_hf, lora_with_random_b, make_model

PROMPTS = [[1, 5, 9, 4], [1, 7, 3, 8, 12, 4, 6, 11, 2, 9], [1, 20]]
NEW = 12  # a prompt of 10 and 12 new tokens: past Gemma's window of 8


@pytest.fixture(scope="module", params=["llama-gqa-rope3-tied", "gemma2-softcap-window",
                                        "gemma3-local-rope", "qwen3-qknorm-tied", "olmoe",
                                        "qwen2-moe"])  # fmt: skip
def model_and_adapter(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = make_model(d / "model", request.param)
    lora_with_random_b(read_model_args(model)).save(d / "adapter", str(model))
    return model, d / "adapter"


def upto_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for k, t in enumerate(tokens):
        if t in stops:
            return tokens[: k + 1]
    return tokens


def test_batched_greedy_tokens_equal_transformers_and_peft_streamed_and_resident(
    model_and_adapter,
):
    model, adapter = model_and_adapter
    peft_model = PeftModel.from_pretrained(load_hf(model), adapter).eval()
    gen = Generator(model, adapter, copies=True)  # blocks copied through slots, as on CUDA
    try:
        L = gen.args.num_layers
        streamed = gen.generate(PROMPTS, Sampling(NEW), Placement(frozenset(), False))
        resident = gen.generate(PROMPTS, Sampling(NEW), Placement(frozenset(range(L)), True))
        stops = gen.stop_ids
    finally:
        gen.close()
    assert streamed == resident
    for prompt, ours in zip(PROMPTS, streamed, strict=True):
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                max_new_tokens=NEW, do_sample=False, eos_token_id=sorted(stops), pad_token_id=0,
            )  # fmt: skip
        theirs = upto_stop(out[0, len(prompt) :].tolist(), stops)
        assert ours == theirs, (prompt, ours, theirs)
        assert len(ours) > 3  # more than a token or two was compared


@pytest.mark.parametrize(
    "variant", ["qwen3_5-hybrid", "qwen3_5-moe", "gemma4-ple-kv-shared", "gemma4-moe", "gpt-oss"]
)
def test_families_it_cannot_decode_yet_are_refused_by_name(variant, tmp_path):
    model = make_model(tmp_path / "model", variant)
    with pytest.raises(ConfigError, match="is not supported yet") as e:
        Generator(model, None)
    assert "\n" not in str(e.value) and read_model_args(model).architecture in str(e.value)


def test_sampling_is_reproducible_by_its_seed_and_the_base_alone_is_transformers(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    lora_with_random_b(read_model_args(model)).save(tmp_path / "adapter", str(model))
    with_adapter, base = Generator(model, tmp_path / "adapter"), Generator(model)
    try:
        draw = Sampling(NEW, temperature=1.0, top_p=0.9, seed=3)
        first = with_adapter.generate(PROMPTS, draw)
        assert with_adapter.generate(PROMPTS, draw) == first
        assert with_adapter.generate(PROMPTS, Sampling(NEW, 1.0, 0.9, seed=4)) != first
        ours = base.generate(PROMPTS[:1], Sampling(NEW))[0]  # no adapter: the base model's
        stops = base.stop_ids
    finally:
        with_adapter.close()
        base.close()
    with torch.no_grad():
        out = load_hf(model).generate(
            input_ids=torch.tensor(PROMPTS[:1]), attention_mask=torch.ones(1, len(PROMPTS[0])),
            max_new_tokens=NEW, do_sample=False, eos_token_id=sorted(stops), pad_token_id=0,
        )  # fmt: skip
    assert ours == upto_stop(out[0, len(PROMPTS[0]) :].tolist(), stops)


def test_generate_command_answers_prompts_from_flags_and_a_file(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    lora_with_random_b(read_model_args(model)).save(tmp_path / "adapter", str(model))
    (tmp_path / "prompts.txt").write_text("the cat sat\n\nthe dog\n")
    argv = ["generate", "--model", str(model), "--adapter", str(tmp_path / "adapter"),
            "--prompt", "a big red", "--prompts", str(tmp_path / "prompts.txt"),
            "--max-new-tokens", "5", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["a big red", "the cat sat", "the dog"]
    assert all(isinstance(line["answer"], str) and line["tokens"] <= 5 for line in lines)
    result = CliRunner().invoke(main, [*argv[:5], "--prompts", str(tmp_path / "none.txt")])
    assert result.exit_code == 1
    assert result.stderr == f"error: --prompts {tmp_path / 'none.txt'}: no such file\n"


def test_placement_keeps_what_the_budget_holds_caches_first_then_blocks():
    GiB = 2**30
    everything = place(8, GiB, GiB // 4, GiB, 12 * GiB, "b")  # 1 + 8 + 2: all of it
    assert everything == Placement(frozenset(range(8)), True)
    streamed = place(8, GiB, GiB // 4, GiB, 7 * GiB, "b")  # 6 left: 2 slots, caches 2, 2 blocks
    assert streamed == Placement(frozenset({0, 1}), True)
    host_caches = place(8, GiB, GiB, GiB, 4 * GiB, "b")  # caches of 8 GiB go to host memory
    assert host_caches == Placement(frozenset({0}), False)
    with pytest.raises(ConfigError, match=r"--gpu-memory-budget: 2.5 GiB usable is too small"):
        place(8, GiB, GiB, GiB, int(2.5 * GiB), "3 prompt(s) of up to 40 tokens")
