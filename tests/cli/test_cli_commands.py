"""The `appliance` subcommands as a user types them: eval, export, bench, and Ctrl-C on train."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel

from appliance.adapter.evaluate import evaluate
from appliance.bench.cli import parser as bench_parser
from appliance.cli.main import main
from appliance.data.records import Holdout
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec
from tests.e2e.test_faults import Proc, args, build_inputs
from tests.helpers_cli import train_in_process
from tests.helpers_model import load_hf, lora_with_random_b, make_model
from tests.helpers_ray import session_processes, wait_gone
from tests.helpers_tokenizer import sentences


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = make_model(root / "model", "llama-mha")
    lora_with_random_b(read_model_args(model), LoraSpec(rank=4, alpha=8.0), seed=3).save(
        root / "adapter"
    )
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(12, seed=4)))
    return model, root / "adapter", data


def test_eval_prints_one_json_line_with_loss_and_tokens(model_and_adapter):
    model, adapter, data = model_and_adapter
    result = CliRunner().invoke(
        main,
        [
            "eval",
            "--model",
            str(model),
            "--adapter",
            str(adapter),
            "--data",
            str(data),
            "--seq-len",
            "10",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    printed = json.loads(lines[0])
    assert set(printed) == {"loss", "tokens", "perplexity", "base_loss", "base_perplexity"}
    assert printed == evaluate(model, data, 10, adapter_dir=adapter, with_base=True)
    assert printed["base_loss"] == evaluate(model, data, 10)["loss"]  # the model alone
    assert printed["perplexity"] == math.exp(printed["loss"])
    # records longer than --seq-len 10 are cut, and stderr says so
    assert result.stderr.startswith("warning: --seq-len 10 cut "), result.stderr
    assert "pass a larger --seq-len" in result.stderr

    # a directory: its files that are not data, and files of several splits, are named first
    d = data.parent / "eval-dir"
    (d / "data").mkdir(parents=True)
    (d / "data" / "test-0.jsonl").write_bytes(data.read_bytes())
    (d / "data" / "validation-0.jsonl").write_text('{"text": "the cat"}\n')
    (d / "README.md").write_text("a dataset card")
    argv = ["eval", "--model", str(model), "--data", str(d), "--seq-len", "64", "--device", "cpu"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"note: --data {d}: skipped 1 file(s) that are not data (.jsonl, .json, .parquet, .arrow, "
        ".csv, .tsv or .txt; all but .parquet and .arrow also .gz, .bz2, .xz or .zst): README.md",
        f"note: --data {d}: its 2 files are named for several splits (1 validation: "
        "data/validation-0.jsonl; 1 test: data/test-0.jsonl), and every one is read: to use one "
        f"split, give --data its files alone (e.g. --data '{d}/data/validation*')",
    ]
    assert json.loads(result.stdout)["tokens"] > printed["tokens"]

    # a pattern that names one split's files: nothing to say, and only they are read
    argv[argv.index("--data") + 1] = str(d / "*" / "test-*.jsonl")
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads(result.stdout) == evaluate(model, data, 64)


def test_eval_and_export_take_the_model_and_seq_len_from_the_adapters_run(
    model_and_adapter, tmp_path
):
    """`--adapter` of a run's output (run.json) or of one of its checkpoints (config.json beside
    the manifest) brings the run's --model, --seq-len, --base-quant and --dtype, and its
    validation set for --data, said in a note; a PEFT adapter brings the base model its adapter_config.json names; with neither,
    the flag is asked for."""
    import shutil

    from appliance.config import build_config

    model, adapter, data = model_and_adapter
    config = build_config({}, {"model": str(model), "data": "d", "output": "o", "seq_len": 12})

    def copy(name: str, **files: dict) -> Path:
        to = shutil.copytree(adapter, tmp_path / name)
        for file, content in files.items():
            (to / file).write_text(json.dumps(content))
        return to

    def invoke(*argv) -> tuple[int, str, str]:
        result = CliRunner().invoke(main, [*map(str, argv)])
        return result.exit_code, result.stdout, result.stderr

    expected = evaluate(model, data, 12, adapter_dir=adapter, with_base=True)
    run = copy("run", **{"run.json": {"status": "complete", "config": config.to_dict()}})
    step = copy("step", **{"config.json": config.to_dict(), "manifest.json": {"step": 2}})
    for made, source in ((run, run / "run.json"), (step, step / "config.json")):
        code, out, err = invoke("eval", "--adapter", made, "--data", data, "--device", "cpu")
        assert code == 0, err
        assert json.loads(out) == expected
        assert err.startswith(f"note: --model {model} --seq-len 12 (from {source})\n"), err
        code, _, err = invoke("export", "--adapter", made, "--output", tmp_path / f"m-{made.name}")
        assert code == 0 and err == f"note: --model {model} (from {source})\n", err
    merged = (tmp_path / "m-run" / "model.safetensors").read_bytes()
    assert merged == (tmp_path / "m-step" / "model.safetensors").read_bytes()

    peft = copy("peft")  # as PEFT saves it: adapter_config.json names the base model
    named = json.loads((peft / "adapter_config.json").read_text())
    named["base_model_name_or_path"] = str(model)
    (peft / "adapter_config.json").write_text(json.dumps(named))
    code, _, err = invoke("export", "--adapter", peft, "--output", tmp_path / "m")
    assert code == 0, err
    assert err == f"note: --model {model} (from {peft}/adapter_config.json)\n"
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == merged
    code, _, err = invoke("eval", "--adapter", peft, "--data", data)
    assert (code, err.splitlines()[-1]) == (1, (
        f"error: --seq-len needed: {peft} holds no run record (run.json, or a checkpoint's "
        "config.json) to take it from"
    )), err  # fmt: skip
    del named["base_model_name_or_path"]
    (peft / "adapter_config.json").write_text(json.dumps(named))
    code, _, err = invoke("eval", "--adapter", peft, "--data", data, "--seq-len", "12")
    assert (code, err) == (1, (
        f"error: --model needed: {peft} holds no run record (run.json, or a checkpoint's "
        "config.json), nor does its adapter_config.json name a base model\n"
    )), err  # fmt: skip
    code, out, err = invoke("eval", "--data", data, "--seq-len", "12")
    assert code == 2 and "--model needed (without --adapter there is no run to take it from)" in err

    # no --data: the run's validation set, here the documents its --eval-split held out
    code, _, err = invoke("eval", "--adapter", run)
    assert (code, err) == (1, (
        f"error: --data needed: the run of {run} had no validation set (--eval-data or "
        "--eval-split) to take it from\n"
    )), err  # fmt: skip
    split = build_config({}, {"model": str(model), "data": str(data), "output": "o",
                              "seq_len": 12, "eval_split": 0.5, "seed": 7})  # fmt: skip
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": split.to_dict()}))
    code, out, err = invoke("eval", "--adapter", run, "--device", "cpu")
    assert code == 0, err
    assert err.startswith(
        f"note: --model {model} --seq-len 12 --data {data} (the 0.5 of it that --seed 7 held out) "
        f"(from {run}/run.json)\n"
    ), err
    held_out = Holdout(0.5, 7, held_out=True)
    assert json.loads(out) == evaluate(
        model, data, 12, adapter_dir=adapter, holdout=held_out, with_base=True
    )
    assert json.loads(out)["tokens"] < evaluate(model, data, 12, adapter_dir=adapter)["tokens"]

    # a QLoRA run's adapter is scored on the base it trained on, unless told otherwise
    qlora = build_config({}, {"model": str(model), "data": "d", "output": "o", "seq_len": 12,
                              "base_quant": "int8", "dtype": "float32"})  # fmt: skip
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": qlora.to_dict()}))
    code, out, err = invoke("eval", "--adapter", run, "--data", data, "--device", "cpu")
    assert code == 0, err
    assert err.startswith(
        f"note: --model {model} --seq-len 12 --base-quant int8 --dtype float32 "
        f"(from {run}/run.json)\n"
    ), err
    quantized = evaluate(model, data, 12, adapter_dir=adapter, base_quant="int8", with_base=True)
    assert json.loads(out) == quantized != expected
    code, out, err = invoke(
        "eval", "--adapter", run, "--data", data, "--base-quant", "none", "--device", "cpu"
    )
    assert code == 0 and json.loads(out) == expected, err
    assert err.startswith(f"note: --model {model} --seq-len 12 --dtype float32 (from"), err
    # a GPU run's bfloat16 is no choice for a CPU: its dtype is taken only on its kind of device
    on_gpu = {**qlora.to_dict(), "base_quant": "none", "device": "cuda", "dtype": "bfloat16"}
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": on_gpu}))
    code, out, err = invoke("eval", "--adapter", run, "--data", data, "--device", "cpu")
    assert code == 0 and json.loads(out) == expected, err
    assert err.startswith(f"note: --model {model} --seq-len 12 (from"), err

    # a path the run recorded that is gone (moved since) is said to be, naming the flag to give
    moved = {**qlora.to_dict(), "model": str(tmp_path / "gone"), "eval_data": str(tmp_path / "e")}
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": moved}))
    for argv in (["eval", "--device", "cpu"], ["export", "--output", tmp_path / "m-gone"]):
        code, _, err = invoke(*argv, "--adapter", run)
        assert (code, err) == (1, (
            f"error: --model {tmp_path / 'gone'} (from {run}/run.json) is not there any more: "
            "if it moved, give its new place with --model PATH\n"
        )), err  # fmt: skip
    code, _, err = invoke("eval", "--device", "cpu", "--adapter", run, "--model", model)
    assert err.endswith(f"error: --data {tmp_path / 'e'} (from {run}/run.json) is not there any "
                        "more: if it moved, give its new place with --data PATH\n"), err  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_eval_on_cuda_without_a_gpu_is_one_error_line(model_and_adapter):
    model, _, data = model_and_adapter
    argv = ["eval", "--model", model, "--data", data, "--seq-len", "10", "--device", "cuda"]
    result = CliRunner().invoke(main, list(map(str, argv)))
    assert result.exit_code == 1, result.output
    assert result.output == (
        "error: --device cuda: no CUDA GPU is visible (use --device cpu or auto)\n"
    )


def test_train_and_eval_refuse_a_tokenizer_with_ids_past_the_model_vocabulary(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha", vocab_size=20)  # the tokenizer has ~38
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(8)))
    common = ["--model", model, "--data", data, "--seq-len", "16"]
    train = ["train", *common, "--output", tmp_path / "o", "--device", "cpu"]
    for argv in (train, ["eval", *common]):
        result = CliRunner().invoke(main, list(map(str, argv)))
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output and "starting Ray" not in result.output
        assert result.output.startswith(f"error: {model / 'tokenizer.json'} gives token ids up")
        assert f"{model / 'config.json'} has vocab_size 20" in result.output


def test_eval_refuses_a_seq_len_above_the_models_sliding_window(tmp_path):
    model = make_model(tmp_path / "model", "mistral", sliding_window=16)
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    flags = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu"]
    ok = CliRunner().invoke(main, [*flags, "--seq-len", "16"])
    assert ok.exit_code == 0, ok.output
    result = CliRunner().invoke(main, [*flags, "--seq-len", "17"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("error: --seq-len 17") and "sliding_window (16)" in lines[0]


def test_export_writes_a_checkpoint_transformers_loads_equal_to_base_plus_adapter(
    model_and_adapter, tmp_path
):
    model, adapter, _ = model_and_adapter
    out = tmp_path / "merged"
    result = CliRunner().invoke(
        main, ["export", "--model", str(model), "--adapter", str(adapter), "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        merged = load_hf(out)(input_ids=ids).logits
        reference = PeftModel.from_pretrained(load_hf(model), adapter)(input_ids=ids).logits
    torch.testing.assert_close(merged, reference, rtol=1e-5, atol=1e-5)
    again = CliRunner().invoke(
        main, ["export", "--model", str(model), "--adapter", str(adapter), "--output", str(out)]
    )
    assert again.exit_code == 1 and "error:" in again.output and str(out) in again.output


def test_bench_tiny_prints_the_table_and_writes_json(tmp_path):
    flags = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "1",
             "--warmup", "0", "--micro-batch-size", "1", "--seq-len", "32",
             "--json", str(tmp_path / "b.json")]  # fmt: skip
    result = CliRunner().invoke(main, ["bench", *flags])
    assert result.exit_code == 0, result.output
    assert "streamed" in result.output and "resident" in result.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["preset"] == "tiny" and data["dtype"] == "float32"
    assert (data["shape"]["steps"], data["shape"]["warmup"]) == (1, 0)


def test_bench_takes_the_same_options_as_python_m_appliance_bench():
    help_text = CliRunner().invoke(main, ["bench", "--help"]).output
    assert help_text.startswith("usage: appliance bench")
    for action in bench_parser()._actions:
        for flag in action.option_strings:
            assert flag in help_text


def test_bench_with_a_bad_gpu_memory_budget_is_one_error_line():
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--gpu-memory-budget", "24QB"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --gpu-memory-budget '24QB'")


@pytest.mark.integration
def test_train_names_the_records_skipped_and_the_held_out_documents_cut(
    ray_local, model_and_adapter, tmp_path
):
    """In this process, on the shared Ray: what the run says is what it is about."""
    model, _, _ = model_and_adapter
    data = tmp_path / "six.jsonl"  # 6 lines, 4 of them bad
    lines = [{"text": "the cat sat on the mat"}, '{"text": "a\tb"}', "[1]", {"body": "x"}]
    lines += [{"text": 5}, {"text": "a dog ran far away"}]
    data.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    held_out = tmp_path / "held_out.jsonl"  # one document longer than --seq-len 8
    held_out.write_text(json.dumps({"text": "the cat sat on the mat and a dog ran far away"}))
    done = train_in_process("--model", model, "--data", data, "--eval-data", held_out,
                            "--output", tmp_path / "o", "--seq-len", "8",
                            "--micro-batch-size", "1", "--tokenize-workers", "1", "--epochs", "1",
                            "--on-bad-record", "skip")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert (
        "warning: --on-bad-record skip left out 4 bad record(s) of the training data; all 4:\n"
        f"  {data}:2: malformed JSON: Invalid control character at column 12"
    ) in output, output
    assert f"  {data}:3: expected a JSON object, found an array\n" in output
    assert f'  {data}:4: record has no "text"' in output
    assert f'  {data}:5: "text" must be a string, found a number\n' in output
    assert "skipped_records 4" in done.stdout
    # validation cuts documents to --seq-len as `appliance eval` does, and says so once
    assert output.count(f"validation: --seq-len 8 cut 1 of 1 document(s) of {held_out}") == 1


@pytest.mark.integration
def test_ctrl_c_stops_training_cleanly(inputs, tmp_path):
    out = tmp_path / "out"
    proc = Proc(args(inputs, out))
    proc.wait_for_step(3)
    family = proc.p.pid
    proc.p.send_signal(signal.SIGINT)
    rc, _, err = proc.finish(timeout=120)
    assert rc == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert not (out / "adapter_config.json").exists()
    # no Ray process of that run is left behind: the ones still ending (a worker notices its
    # raylet is gone a moment later, longer on a busy machine) end within EXIT_WAIT_S
    wait_gone(session_processes(family))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("ctrl-c"))
