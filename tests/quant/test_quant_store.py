"""--base-quant through the real parts: the WeightStore as a Ray actor, `appliance train` on
embedded Ray, the run's identity (a resume keeps the quantization), `appliance eval`."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from click.testing import CliRunner
from peft import PeftModel

from appliance import quant
from appliance.actors.weight_store import WeightStore, local_source
from appliance.cli.main import main
from appliance.config import build_config
from appliance.errors import ConfigError
from appliance.models import param_count
from appliance.run.driver import train
from appliance.run.progress import Progress
from appliance.run.record import RUN_FILE
from appliance.run.resume import decide_output
from tests.helpers_model import load_hf, make_model, tiny_train_config
from tests.helpers_tokenizer import sentences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q") / "model", "llama-gqa-rope3-tied")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(40, seed=2)))
    return path


@pytest.mark.integration
def test_the_store_actor_hands_out_the_same_quantized_blocks(ray_local, model_dir):
    store = ray.remote(num_cpus=0)(WeightStore).remote(str(model_dir), "float32", "nf4")
    remote = ray.get(store.handles.remote()).source()  # zero-copy views of shared memory
    local = local_source(model_dir, "float32", "nf4")
    assert ray.get(store.stats.remote())["base_quant"] == "nf4"
    for i in range(local.num_blocks):
        a, b = remote.block(i), local.block(i)
        assert a.keys() == b.keys()
        for name in a:
            if quant.is_linear_weight(name):
                assert torch.equal(a[name].codes, b[name].codes)
                assert torch.equal(a[name].scales, b[name].scales)
            else:
                assert torch.equal(a[name], b[name])


@pytest.mark.integration
def test_train_on_an_nf4_base_and_resume_keeps_its_quantization(
    ray_local, model_dir, data, tmp_path
):
    out = tmp_path / "out"
    cfg = tiny_train_config(model_dir, data, out, steps=2, base_quant="nf4", eval_split=0.25)
    summary = train(cfg, Progress("json"))
    assert summary["steps"] == 2
    record = json.loads((out / RUN_FILE).read_text())
    assert record["identity"]["base_quant"] == "nf4"
    PeftModel.from_pretrained(load_hf(model_dir), out)  # the adapter loads on the plain base
    # `appliance eval --adapter OUT` alone scores it as the run validated it: on the nf4 base
    result = CliRunner().invoke(main, ["eval", "--adapter", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "--base-quant nf4" in result.stderr.splitlines()[0], result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    argv = ["eval", "--adapter", str(out), "--device", "cpu", "--base-quant", "none"]
    plain = CliRunner().invoke(main, argv)  # the unquantized base, as PEFT loads it
    assert plain.exit_code == 0 and json.loads(plain.stdout)["loss"] != summary["eval_loss"]

    same = {"eval_split": 0.25, "resume": True}
    decide_output(tiny_train_config(model_dir, data, out, base_quant="nf4", **same))
    with pytest.raises(ConfigError, match="different --base-quant"):
        decide_output(tiny_train_config(model_dir, data, out, **same))  # base_quant: none


def test_base_quant_is_a_checked_flag():
    assert build_config({}, {"base_quant": "int8"}).base_quant == "int8"
    with pytest.raises(ConfigError, match=r"--base-quant must be one of none \| int8 \| nf4"):
        build_config({}, {"base_quant": "int4"})


def test_eval_cli_with_base_quant_refuses_an_integer_weight_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_model(tmp_path / "model", "llama-mha")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    argv = ["eval", "--model", str(model_dir), "--data", str(data), "--seq-len", "8"]
    result = CliRunner().invoke(main, [*argv, "--base-quant", "nf4", "--device", "cpu"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: {name}: dtype I32 is not floating point; --base-quant needs float weights "
        "(the checkpoint is already quantized? use --base-quant none)"
    ]


def test_a_nan_in_a_weight_the_store_quantizes_names_the_checkpoint_tensor(tmp_path):
    """The store codes each block's weights under their short names: the error names the
    checkpoint's tensor, layer included (a damaged download is found by its name)."""
    from safetensors.torch import load_file, save_file

    model_dir = make_model(tmp_path / "model", "llama-mha")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][0, 5] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    from appliance.errors import ModelError

    with pytest.raises(ModelError, match=rf"^{name}: values 0\.\.63 \(flattened\) holds inf or"):
        WeightStore(model_dir, "float32", "nf4").handles()


def test_the_load_bench_checkpoint_is_a_valid_sharded_model(tmp_path):
    from appliance.bench.load import LLAMA_1B, read_files, write_checkpoint
    from appliance.models.hf_checkpoint import SafetensorsCheckpoint, read_model_args

    small = {**LLAMA_1B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
    small.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    written = write_checkpoint(tmp_path / "m", small, shard_bytes=40_000)
    args = read_model_args(tmp_path / "m")
    SafetensorsCheckpoint(tmp_path / "m").check(args)  # every tensor, with its shape
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    assert written == param_count(args) * 2  # bf16
    assert read_files(tmp_path / "m")[0] > written  # the files: tensors + headers
    assert WeightStore(tmp_path / "m", "bfloat16").handles().nbytes >= written


def test_the_load_bench_times_both_quantizers_and_prints_them():
    """The kernel table of `appliance bench --load`: the fused C kernel (built by the install) and
    the PyTorch functions, for each --quant asked (none has no quantizer)."""
    from appliance.bench.load import format_table, kernel_rates

    rows = kernel_rates(["none", "nf4", "int8"], repeats=1)
    assert [(r["quant"], r["impl"]) for r in rows] == [
        ("nf4", "torch"),
        ("nf4", "fused"),
        ("int8", "torch"),
        ("int8", "fused"),
    ]
    assert all(r["ns_per_value"] > 0 for r in rows)
    result = {
        "model": "m",
        "checkpoint_bytes": 1,
        "cpus": 2,
        "load_average": (0.0, 0.0, 0.0),
        "read": {"seconds": 1.0, "gb_per_second": 1.0},
        "store": [],
        "kernels": rows,
    }
    table = format_table(result)
    assert "| int8 torch |" in table and "| nf4 torch |" in table
    assert f"| nf4 fused, {rows[1]['isa']} |" in table  # the fused rows name their ISA
    assert rows[1]["isa"] and "isa" not in rows[0]
