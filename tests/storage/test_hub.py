"""What a model that cannot be used is told: a hub id that is not in the local cache (the command
that downloads it), only pytorch_model.bin (the command that converts it, run here). A dataset id
(`--data org/name`) read from the local cache, and the command that downloads one that is not
there. A cached model id training and evaluating: tests/e2e/test_run_ux.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from appliance.adapter.evaluate import evaluate
from appliance.errors import DataError, ModelError
from appliance.models.hf_checkpoint import SafetensorsCheckpoint, read_model_args
from appliance.run.inputs import prepare
from tests.helpers_model import make_model, tiny_train_config
from tests.helpers_tokenizer import sentences


def appliance(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "appliance", *argv],
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


def dataset_cache(hub: Path) -> Path:
    """`tiny-org/chat` as `hf download tiny-org/chat --repo-type dataset` leaves it in the hub
    cache `hub`: blobs, a snapshot whose files link to them, refs/main naming its commit. The
    snapshot holds a dataset card and a train and a test split."""
    repo = hub / "datasets--tiny-org--chat"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = repo / "snapshots" / commit
    files = {
        "README.md": "a dataset card",
        "data/train-00000-of-00001.jsonl": "".join(
            json.dumps({"text": t}) + "\n" for t in sentences(6, seed=1)
        ),
        "data/test-00000-of-00001.jsonl": json.dumps({"text": "the cat"}) + "\n",
    }
    (repo / "blobs").mkdir(parents=True)
    for i, (rel, text) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_text(text)
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(os.path.relpath(blob, (snapshot / rel).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_dataset_id_is_read_from_the_local_cache_or_named_with_its_download_command(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    snapshot = dataset_cache(tmp_path / "hf" / "hub")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}

    argv = ["--model", str(model), "--seq-len", "16", "--device", "cpu"]
    result = appliance("eval", *argv, "--data", "tiny-org/chat", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == evaluate(model, snapshot, 16)  # the snapshot's documents
    assert "note: --data tiny-org/chat: skipped 1 file(s) that are not data" in result.stderr
    assert "--data tiny-org/chat: its 2 files are named for several splits" in result.stderr
    assert "(e.g. --data 'tiny-org/chat/data/train*')" in result.stderr

    # what the note says: a pattern inside the dataset picks one split, as datasets' data_files
    result = appliance("eval", *argv, "--data", "tiny-org/chat/data/train*", env=env)
    assert result.returncode == 0, result.stderr
    train = snapshot / "data" / "train-00000-of-00001.jsonl"
    assert json.loads(result.stdout) == evaluate(model, train, 16)
    assert result.stderr == ""
    result = appliance("eval", *argv, "--data", "tiny-org/none/data/train*", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: --data tiny-org/none: not a file or directory here")

    result = appliance("eval", *argv, "--data", "tiny-org/typo.jsonl", env=env)  # a path
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == "error: no such file or directory: tiny-org/typo.jsonl: check the path"
    )

    result = appliance("eval", *argv, "--data", "tiny-org/none@v2", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "error: --data tiny-org/none@v2: not a file or directory here and not in the local "
        f"Hugging Face cache ({tmp_path / 'hf' / 'hub'}); download it with `hf download "
        "tiny-org/none --repo-type dataset --revision v2` (or `hf download tiny-org/none "
        "--repo-type dataset --local-dir DIR` and pass --data DIR)"
    )


def test_train_reads_data_and_eval_data_given_as_dataset_ids(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at each lookup
    snapshot = dataset_cache(tmp_path / "hub")
    model = make_model(tmp_path / "model", "llama-mha")
    cfg = tiny_train_config(model, "tiny-org/chat", tmp_path / "out", eval_data="tiny-org/chat")
    inp = prepare(cfg)
    assert inp.data_path == snapshot and inp.eval_data == snapshot
    assert inp.cfg.data == inp.cfg.eval_data == str(snapshot)  # what run.json records
    assert any(f"--data {snapshot}: its 2 files are named for several" in n for n in inp.notes)
    inp = prepare(
        tiny_train_config(
            model, "tiny-org/chat/data/train-*", tmp_path / "out", eval_data="tiny-org/chat/*/test*"
        )
    )
    assert inp.data_path == snapshot / "data" / "train-*" and inp.notes == []
    assert inp.eval_data == snapshot / "*" / "test*"
    with pytest.raises(DataError, match=r"^--eval-data tiny-org/gone: not a file or directory"):
        prepare(
            tiny_train_config(model, "tiny-org/chat", tmp_path / "o", eval_data="tiny-org/gone")
        )
