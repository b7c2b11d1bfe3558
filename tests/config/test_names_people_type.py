"""Names people already type (issue 45, item 6): Hugging Face's and axolotl's keys in config
files, PEFT's target names, flags that point to the appliance's own, hints with the command as
it can be typed, and an adapter or a run given as --model."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.config import build_config
from appliance.errors import ConfigError, ModelError, appliance_command
from appliance.models.hf_checkpoint import read_model_args

GIVEN = {"model": "m", "data": "d", "output": "o"}


def test_hf_and_axolotl_keys_are_read_as_the_appliances_with_a_note():
    notes: list[str] = []
    file = {"learning_rate": 1e-4, "num_train_epochs": 2.0, "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 8, "warmup_ratio": 0.05}  # fmt: skip
    cfg = build_config(file, GIVEN, source="--config hf.yaml", notes=notes)
    assert (cfg.lr, cfg.epochs, cfg.micro_batch_size, cfg.micro_batches_per_step) == (1e-4, 2, 2, 8)
    assert cfg.warmup_ratio == 0.05  # the appliance's own key now
    assert notes == [
        "--config hf.yaml: read learning_rate as lr, num_train_epochs as epochs, "
        "per_device_train_batch_size as micro_batch_size, gradient_accumulation_steps as "
        "micro_batches_per_step (the appliance's names)"
    ]
    with pytest.raises(ConfigError, match="learning_rate and lr are one setting: give one"):
        build_config({"learning_rate": 1e-4, "lr": 2e-4}, GIVEN, source="--config hf.yaml")


def test_peft_target_names_and_all_linear():
    targets = build_config({"lora_target_modules": ["q_proj", "self_attn.v_proj"]}, GIVEN)
    assert targets.lora_targets == ("q", "v")
    every = build_config({}, {**GIVEN, "lora_targets": "all-linear"}).lora_targets
    assert every == ("q", "k", "v", "o", "gate", "up", "down")
    assert build_config({}, {**GIVEN, "lora_targets": "qkv_proj,o"}).lora_targets == ("qkv", "o")
    with pytest.raises(ConfigError, match="--lora-targets: lm_head not among"):
        build_config({}, {**GIVEN, "lora_targets": "q_proj,lm_head"})


def test_a_flag_by_another_name_points_to_the_appliances():
    result = CliRunner().invoke(main, ["train", "--learning-rate", "1e-4"])
    assert result.exit_code == 2
    assert "No such option '--learning-rate'. Did you mean '--lr'?" in result.output


def test_hints_give_the_command_as_it_can_be_typed(tmp_path, monkeypatch):
    script = tmp_path / ".venv" / "bin" / "appliance"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(sys, "argv", [str(script), "train"])
    assert appliance_command() == os.path.join(".venv", "bin", "appliance")  # not on the PATH
    monkeypatch.setenv("PATH", str(script.parent))
    assert appliance_command() == "appliance"
    main_py = os.path.join(os.path.dirname(__file__), "x", "appliance", "__main__.py")
    monkeypatch.setattr(sys, "argv", [main_py, "train"])  # python -m appliance
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert appliance_command() == f"{sys.executable} -m appliance"
    monkeypatch.setattr(sys, "argv", ["pytest"])  # not the command line: its name
    assert appliance_command() == "appliance"


def test_an_adapter_or_a_run_given_as_model_names_its_base(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "meta-llama/Llama-2-7b-hf", "peft_type": "LORA"})
    )
    with pytest.raises(ModelError) as e:
        read_model_args(adapter)
    assert str(e.value) == (
        f"{adapter} is a LoRA adapter (adapter_config.json), not a base model: its base model is "
        "meta-llama/Llama-2-7b-hf. Give the base model as --model, and this directory as "
        "--adapter (appliance eval, export)"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"model": "/models/base"}}))
    (run / "adapter_config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    argv = ["eval", "--model", str(run), "--data", str(data), "--seq-len", "8"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"error: {run} is the output of an appliance run (run.json), not a base model: its base "
        "model is /models/base. Give the base model as --model, and this directory as --adapter "
        f"(appliance eval, export); to train it further: appliance train --output {run} --resume"
    )
