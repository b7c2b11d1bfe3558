"""The merged model follows the umask, as every other output does (issue 44, item 13): its
model.safetensors was written 0600 (safetensors' save_file), the files copied from the base model
kept the base model's mode."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import LoraSpec
from tests.helpers_model import lora_with_random_b, make_model


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_an_export_follows_the_umask(tmp_path, umask):
    model = make_model(tmp_path / "model", "llama-mha")
    (model / "config.json").chmod(0o444)  # a read-only base (a shared cache): not carried over
    adapter = tmp_path / "adapter"
    lora_with_random_b(read_model_args(model), LoraSpec(rank=4, alpha=8.0), seed=1).save(adapter)
    out = tmp_path / "merged"
    done = subprocess.run(
        ["sh", "-c", f'umask {umask:03o}; exec "$@"', "sh", sys.executable, "-m", "appliance",
         "export", "--model", str(model), "--adapter", str(adapter), "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
