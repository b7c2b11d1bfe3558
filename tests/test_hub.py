"""What a model that cannot be used is told: a hub id that is not in the local cache (the command
that downloads it), only pytorch_model.bin (the command that converts it, run here). A cached hub
id training and evaluating: tests/test_run_ux.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from appliance.errors import ModelError
from appliance.hf_checkpoint import SafetensorsCheckpoint, read_model_args
from tests.helpers_model import make_model


def appliance(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    "command",
    [("eval", "--data", "x.jsonl", "--seq-len", "8"), ("plan", "--gpu", "a10"), ("doctor",)],
)
def test_a_hub_id_that_is_not_cached_says_how_to_download_it(tmp_path, command):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    result = appliance(command[0], "--model", "nobody/nothing", *command[1:], env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--model nobody/nothing: not a directory here and not in the local Hugging Face " in (
        result.stderr
    )
    assert "`hf download nobody/nothing`" in result.stderr
    assert "--local-dir DIR" in result.stderr


def test_a_pytorch_bin_model_gets_the_command_that_converts_it(tmp_path):
    source = make_model(tmp_path / "src", "llama-mha")
    model = tmp_path / "bin-model"
    model.mkdir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    torch.save(hf.state_dict(), model / "pytorch_model.bin")  # as older uploads have it
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((source / name).read_bytes())
    with pytest.raises(ModelError, match="only pytorch_model") as caught:
        SafetensorsCheckpoint(model)
    message = str(caught.value)
    command = re.search(r'python -c "(.*)" and pass --model (\S+)$', message)
    assert command, message
    exec(command.group(1), {})  # what `python -c` runs (in this process: transformers is loaded)
    converted = Path(command.group(2))
    SafetensorsCheckpoint(converted).check(read_model_args(converted))
    assert (converted / "tokenizer.json").is_file()
