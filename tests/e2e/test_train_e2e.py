"""`appliance train` end to end on embedded Ray: the three actor kinds train a tiny HF checkpoint.

The actor plumbing must change nothing: the per-step losses equal the same run with the engine
called in-process (same data order), the adapter loads with peft, tokenization happens in the
worker processes, and the weights are shared into the trainer, not copied.
"""

from __future__ import annotations

import json
import math
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from click.testing import CliRunner
from peft import PeftModel

from appliance import models
from appliance.actors.tokenize_worker import TokenizeWorker
from appliance.actors.trainer import Trainer, TrainerSettings
from appliance.actors.weight_store import WeightStore
from appliance.cli.main import main
from appliance.config import build_config
from appliance.engine.blocks import DictBlockSource
from appliance.engine.schedule import lr_at
from appliance.engine.step import StreamedEngine
from appliance.models.hf_checkpoint import read_model_args
from appliance.models.lora import load_adapter
from appliance.run.driver import train
from appliance.run.feed import schedule, worker_kwargs
from appliance.run.inputs import prepare
from appliance.run.launch import trainer_settings
from appliance.run.loop import Run
from appliance.run.progress import Progress
from appliance.storage.checkpoints import CheckpointError
from tests.helpers_model import load_hf, make_model, tiny_train_config
from tests.helpers_tokenizer import sentences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "model", "llama-gqa-rope3-tied")


def write_jsonl(path, n=60, seed=0):
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(n, seed=seed)))
    return path


def in_process_losses(cfg, model_dir, total_steps, counts=None):
    """The same run without Ray: plain workers, the same schedule, the engine in-process."""
    inp = prepare(build_config({}, {**cfg.to_dict(), "output": cfg.output + "-ref"}))
    n = cfg.tokenize_workers
    epochs = None if cfg.steps else 1
    workers = [TokenizeWorker(**worker_kwargs(inp, w, n, epochs)) for w in range(n)]
    settings = TrainerSettings(lora=cfg.lora_spec(), grad_clip=cfg.grad_clip, seed=cfg.seed)
    trainer = Trainer(WeightStore(str(model_dir), "float32").handles(), settings)
    order = schedule(counts, n, total_steps * cfg.micro_batches_per_step)
    losses = []
    M = cfg.micro_batches_per_step
    for step in range(total_steps):
        batches = [workers[w].next_batch() for w in order[step * M : (step + 1) * M]]
        lr = lr_at(
            step,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=cfg.min_lr_ratio,
        )
        losses.append(trainer.step(batches, lr)["loss"])
    return losses, trainer


def test_actors_train_and_losses_equal_the_in_process_engine(ray_local, model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl")
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", steps=6)
    summary = train(cfg, Progress("json"))
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["status"] == "complete" and summary["steps"] == 6
    assert run["restarts"] == 0  # a run nothing kills restarts nothing

    # on as many threads as the trainer actor (Ray's rule: OMP_NUM_THREADS, else its one CPU),
    # the CPU's kernels sum in the same order: the same losses and adapter, bit for bit (on
    # other thread counts AdamW's eps turns the rounding of near-zero gradients into ~1e-6)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    try:
        ref_losses, ref_trainer = in_process_losses(cfg, model_dir, 6)
    finally:
        torch.set_num_threads(threads)
    assert run["losses"] == ref_losses
    assert run["losses"][-1] < run["losses"][0]  # it learned something

    # the adapter loads with peft, no missing/unexpected keys, and reproduces our logits
    base = load_hf(model_dir)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "out")
    ids = torch.randint(3, 40, (2, 12))
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    ours = StreamedEngine(source, load_adapter(tmp_path / "out", source.args)).logits(ids)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # and it is the in-process run's adapter
    ref_sd = ref_trainer.lora.peft_state_dict()
    got = load_adapter(tmp_path / "out", source.args).peft_state_dict()
    assert got.keys() == ref_sd.keys()
    for k in ref_sd:
        assert torch.equal(got[k], ref_sd[k]), k


def test_tokenization_happens_in_the_workers_and_each_token_is_trained_once(
    ray_local, model_dir, tmp_path
):
    data = write_jsonl(tmp_path / "data.jsonl", n=90, seed=3)
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", epochs=1, tokenize_workers=2)
    run = Run(prepare(cfg), Progress("json"))
    run.create_actors()
    trainer_pid = ray.get(run.trainers[0].info.remote())["pid"]
    worker_pids = {ray.get(w.stats.remote())["pid"] for w in run.workers}
    state = run.train()

    assert state.tokenizer_pids == worker_pids
    assert trainer_pid not in worker_pids and len(worker_pids) == 2
    # one epoch: every batch of every shard consumed exactly once...
    assert state.consumed == sum(run.counts)
    # ...so the trained targets are all the dataset's tokens but each document's first (packed
    # by documents; no document is longer than a row here, so none is split)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    dataset_tokens = sum(len(tok.encode(d).ids) + 1 for d in docs)  # + EOS per document
    assert state.target_tokens == dataset_tokens - len(docs)


def test_the_run_notes_skipped_files_several_splits_and_eval_files_it_trains_on(
    model_dir, tmp_path
):
    data, held_out = tmp_path / "ds", tmp_path / "ev"
    for d in (data / "data", held_out):
        d.mkdir(parents=True)
    write_jsonl(data / "data" / "train-0.jsonl")
    write_jsonl(data / "data" / "test-0.jsonl", n=5, seed=1)
    (data / "README.md").write_text("a dataset card")
    write_jsonl(held_out / "a.jsonl", n=5, seed=2)
    (held_out / "scores.xlsx").write_text("a,b\n")
    (held_out / "b.jsonl").symlink_to(data / "data" / "test-0.jsonl")  # trained on: not held out
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", steps=1, eval_data=str(held_out))
    notes = prepare(cfg).notes  # what `appliance train` prints before it starts the actors
    assert len(notes) == 4
    assert notes[0].startswith(f"--data {data}: skipped 1 file(s) that are not data (")
    assert notes[0].endswith(": README.md")
    assert notes[1].startswith(f"--data {data}: its 2 files are named for several splits (")
    assert notes[2].startswith(f"--eval-data {held_out}: skipped 1 file(s) that are not data (")
    assert notes[2].endswith(": scores.xlsx")
    assert notes[3] == (
        f"--eval-data {held_out}: 1 of its files are --data's too, so its loss is not held out "
        f"({data / 'data' / 'test-0.jsonl'}): give files the run does not train on, or --eval-split"
    )
    assert "(1 train: data/train-0.jsonl; 1 test: data/test-0.jsonl)" in notes[1]


def test_schedule_round_robins_and_skips_used_up_workers():
    assert schedule(None, 3, 7) == [0, 1, 2, 0, 1, 2, 0]
    assert schedule([2, 4, 1], 3, 100) == [0, 1, 2, 0, 1, 1, 1]


def test_weights_are_shared_into_the_trainer_not_copied(ray_local, tmp_path):
    big = make_model(
        tmp_path / "big",
        "llama-mha",
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        with_tokenizer=False,
    )
    small = make_model(tmp_path / "small", "llama-mha", with_tokenizer=False)
    settings = TrainerSettings(lora=build_config({}, {"lora_rank": 2}).lora_spec())
    RemoteStore, RemoteTrainer = ray.remote(WeightStore), ray.remote(Trainer)

    def trainer_private_bytes(model):
        store = RemoteStore.remote(str(model), "float32")
        handles = ray.get(store.handles.remote())
        trainer = RemoteTrainer.remote(handles, settings)
        # touch every weight once: a step over one short row
        batch = _batch(1, 8)
        ray.get(trainer.step.remote([batch], 1e-3))
        info = ray.get(trainer.info.remote())
        return info, handles.nbytes

    small_info, _ = trainer_private_bytes(small)
    big_info, model_bytes = trainer_private_bytes(big)
    assert model_bytes > 40 * 2**20
    grown = big_info["uss"] - small_info["uss"]
    assert grown < 0.25 * model_bytes, (grown, model_bytes)
    assert big_info["rss"] - big_info["uss"] > 0.9 * model_bytes  # mapped, shared pages


def _batch(rows, T):
    from appliance.data.records import Batch

    ids = np.arange(rows * T, dtype=np.int64).reshape(rows, T) % 50 + 3
    return Batch(ids, ids.copy(), {}, 0, 0, 0, ids.size, 0)


def test_trainer_and_store_work_as_plain_classes(model_dir):
    store = WeightStore(str(model_dir), "float32")
    handles = store.handles()
    assert store.handles() is handles and store.load_count == 1
    trainer = Trainer(handles, TrainerSettings(lora=build_config({}, {}).lora_spec()))
    stats = trainer.step([_batch(2, 8)], 1e-3)
    assert math.isfinite(stats["loss"]) and stats["tokens"] == 16
    assert set(stats["phase_seconds"]) >= {"forward", "backward", "optimizer", "data_wait"}


def test_the_builtin_demo_drops_held_out_loss_by_at_least_30_percent(ray_local, capsys):
    """`appliance train` with no arguments (what `make train` runs): a loss-regression check."""
    summary = train(build_config({}, {"log_format": "json"}), Progress("json"))
    assert summary["steps"] == 300
    assert summary["eval_loss_drop"] >= 0.30, summary
    # it ends with the command to try next, which runs as printed (the adapter's run brings its
    # model, --seq-len and held-out corpus) and scores that corpus as the run's last validation
    line = next(x for x in capsys.readouterr().err.splitlines() if "appliance eval" in x)
    argv = line.split("appliance eval ", 1)[1].split(" (", 1)[0].split()
    assert argv[::2] == ["--adapter"], line
    result = CliRunner().invoke(main, ["eval", *argv])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] == pytest.approx(summary["eval_loss"], rel=1e-4)


def test_loading_holds_about_one_copy_of_the_weights(tmp_path):
    """The WeightStore reads block by block: peak host memory grows by ~1× the model, not 2×."""
    import subprocess
    import sys

    model = make_model(
        tmp_path / "m",
        "llama-mha",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        with_tokenizer=False,
    )
    probe = (  # sample RSS while loading: ru_maxrss would also count the import-time peak
        "import sys, threading, time, psutil, ray, torch\n"
        "from appliance.actors.weight_store import WeightStore\n"
        "proc = psutil.Process(); base = proc.memory_info().rss; peak = [base]; done = []\n"
        "def watch():\n"
        "    while not done:\n"
        "        peak[0] = max(peak[0], proc.memory_info().rss); time.sleep(0.002)\n"
        "t = threading.Thread(target=watch); t.start()\n"
        "h = WeightStore(sys.argv[1], 'float32').handles()\n"
        "done.append(1); t.join()\n"
        "print(h.nbytes, peak[0] - base)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(model)], capture_output=True, text=True, check=True
    ).stdout.split()
    model_bytes, grown = int(out[0]), int(out[1])
    assert model_bytes > 90 * 2**20
    assert grown < 1.4 * model_bytes, (grown, model_bytes)


# ---------------------------------------------------------------------- through the real driver


def _finish(run: Run) -> None:
    run.stop()  # the module's Ray is shared: free the CPUs for the next test


def test_each_label_token_of_an_epoch_is_trained_exactly_once(ray_local, model_dir, tmp_path):
    """The multiset of label tokens the trainers received (two of them, two workers) is the
    dataset's tokens, less each document's first token (packed by documents, a document's first
    token is never a target)."""
    from collections import Counter

    from tokenizers import Tokenizer

    class Recording(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen: list[int] = []

        def step(self, batches, lr, first=0):
            batches = [ray.get(b) if isinstance(b, ray.ObjectRef) else b for b in batches]
            for b in batches:
                labels = np.asarray(b.labels).ravel()
                self.seen.extend(int(t) for t in labels[labels != -100])
            return super().step(batches, lr, first)

        def seen_labels(self) -> list[int]:
            return self.seen

    data = write_jsonl(tmp_path / "data.jsonl", n=90, seed=4)
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", epochs=1, trainers=2)
    run = Run(prepare(cfg), Progress("json"))
    run.trainer_class = Recording
    run.create_actors()
    run.train()
    seen = Counter(t for r in run.trainers for t in ray.get(r.seen_labels.remote()))
    _finish(run)

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    expected = Counter(t for d in docs for t in [*tok.encode(d).ids, run.inp.eos_id])
    bos = tok.encode(docs[0]).ids[0]
    expected[bos] -= len(docs)  # each document starts with a BOS, never a target
    assert seen == expected


def test_batches_in_flight_stay_within_the_prefetch_window(ray_local, model_dir, tmp_path):
    class Recorder(Progress):
        def __init__(self):
            super().__init__("json", stream=open(os.devnull, "w"))  # noqa: SIM115
            self.records: list[dict] = []

        def step(self, step, stats):
            self.records.append(stats)
            super().step(step, stats)

    data = write_jsonl(tmp_path / "data.jsonl")
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", steps=8, prefetch=1)
    progress = Recorder()
    run = Run(prepare(cfg), progress)
    run.create_actors()
    run.train()
    _finish(run)
    M = cfg.micro_batches_per_step
    in_flight = [r["batches_in_flight"] for r in progress.records]
    assert len(in_flight) == 8
    assert max(in_flight) <= (cfg.prefetch + 1) * M
    assert max(in_flight) == cfg.prefetch * M  # the window is used, not just bounded


def test_a_trainer_whose_init_raises_a_user_error_is_not_restarted(ray_local, model_dir, tmp_path):
    from appliance.errors import ConfigError
    from appliance.run.failures import ActorStartFailed

    class Refuses(Trainer):
        def __init__(self, *args, **kwargs):
            raise ConfigError("--gpu-memory-budget 1GiB is too small for this model")

    data = write_jsonl(tmp_path / "data.jsonl")
    run = Run(
        prepare(tiny_train_config(model_dir, data, tmp_path / "out", steps=2)), Progress("json")
    )
    run.trainer_class = Refuses
    run.create_actors()
    with pytest.raises(ActorStartFailed) as e:
        run.train()  # the first step finds the trainer dead of its __init__
    _finish(run)
    assert str(e.value) == "--gpu-memory-budget 1GiB is too small for this model"
    assert run.restarts == 0


def test_the_failure_past_max_restarts_is_not_counted_as_a_restart(ray_local, model_dir, tmp_path):
    from appliance.run.failures import RestartsExhausted

    class DiesEveryStep(Trainer):
        def step(self, batches, lr, first=0):
            os.kill(os.getpid(), signal.SIGKILL)

    data = write_jsonl(tmp_path / "data.jsonl")
    cfg = tiny_train_config(model_dir, data, tmp_path / "out", steps=3, max_restarts=1)
    run = Run(prepare(cfg), Progress("json"))
    run.trainer_class = DiesEveryStep
    run.create_actors()
    with pytest.raises(RestartsExhausted, match=r"after 1 restarts .*last failure \(trainer\): "):
        run.train()
    _finish(run)
    assert run.restarts == 1


def test_trainer_deaths_in_a_checkpoint_and_in_finish_are_recovered(ray_local, model_dir, tmp_path):
    """adapter_files is called by each checkpoint and by finish: the trainer dies in the first
    checkpoint (step 2, none to restore: from the start) and again in finish (from step 4)."""
    calls = tmp_path / "adapter_files_calls"

    class DiesTwice(Trainer):
        def adapter_files(self):
            n = len(calls.read_text()) if calls.exists() else 0
            calls.write_text("x" * (n + 1))
            if n + 1 in (1, 4):  # checkpoint@2 (first try), then checkpoint@2, @4, finish
                os.kill(os.getpid(), signal.SIGKILL)
            return super().adapter_files()

    data = write_jsonl(tmp_path / "data.jsonl")
    cfg = tiny_train_config(model_dir, data, tmp_path / "dies", steps=4, checkpoint_every=2)
    run = Run(prepare(cfg), Progress("json"))
    run.trainer_class = DiesTwice
    run.create_actors()
    run.train()
    run.finish()
    _finish(run)
    died = json.loads((tmp_path / "dies" / "run.json").read_text())
    assert len(calls.read_text()) == 5 and died["restarts"] == 2
    # the reference: the same run without deaths, its engine called in-process (the actors'
    # run equals it: test_actors_train_and_losses_equal_the_in_process_engine), on the trainer
    # actor's thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    try:
        ref_losses, ref_trainer = in_process_losses(cfg, model_dir, 4)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(died["losses"], ref_losses, rtol=1e-6)
    assert died["weight_store_loads"] == 1  # the base model was loaded once, restarts or not
    a = load_adapter(tmp_path / "dies", read_model_args(model_dir)).peft_state_dict()
    b = ref_trainer.lora.peft_state_dict()
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    # the checkpoint records the config as resolved and used, not "auto"
    ckpt = json.loads(
        (tmp_path / "dies" / "checkpoints" / "step-000004" / "config.json").read_text()
    )
    assert (ckpt["device"], ckpt["dtype"], ckpt["trainers"], ckpt["tokenize_workers"]) == (
        "cpu",
        "float32",
        1,
        2,
    )


def test_checkpoints_and_the_adapter_never_pass_through_the_driver(
    ray_local, model_dir, tmp_path, monkeypatch
):
    """Rank 0 writes the checkpoints and the final adapter and reads the checkpoint a run resumes
    from: the driver (this process) neither writes nor reads their big files, the adapter's
    weights and the trainer state (about 12 GiB for 70B at rank 64; on a cluster the driver runs
    on a small head node). It reads only its own state, to resume, and checks the sizes of
    the others."""
    from appliance.storage import uri as storage
    from appliance.storage.checkpoints import load_latest_checkpoint

    seen: list[tuple[str, str]] = []
    real_read, real_write = storage.read_bytes, storage.write_bytes

    def read(uri, *args, **kwargs):
        seen.append(("read", str(uri)))
        return real_read(uri, *args, **kwargs)

    def write(uri, *args, **kwargs):
        seen.append(("write", str(uri)))
        return real_write(uri, *args, **kwargs)

    # this process only: the trainers, the actors that do the writing, have their own module
    monkeypatch.setattr(storage, "read_bytes", read)
    monkeypatch.setattr(storage, "write_bytes", write)
    data = write_jsonl(tmp_path / "data.jsonl")
    out = tmp_path / "out"
    for steps, resume in ((4, False), (6, True)):
        cfg = tiny_train_config(
            model_dir, data, out, steps=steps, checkpoint_every=2, resume=resume
        )
        run = Run(prepare(cfg), Progress("json"))
        run.create_actors()
        run.train()
        run.finish()
        _finish(run)
    assert run.state.step == 6 and len(run.state.losses) == 6  # resumed at 4, trained 5 and 6
    big = ("trainer_state.pt", "adapter_model.safetensors")
    assert [(op, uri) for op, uri in seen if uri.endswith(big)] == []
    assert ("read", str(out / "checkpoints" / "step-000004" / "driver_state.json")) in seen
    assert load_latest_checkpoint(str(out)).step == 6  # written, complete, by rank 0
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert (out / "adapter_model.safetensors").stat().st_size > 0

    # it checks their sizes, so trainer states all truncated stop a resume before a model loads
    states = sorted(out.glob("checkpoints/step-*/trainer_state.pt"))
    assert states
    for state in states:
        state.write_bytes(state.read_bytes()[:100])
    cfg = tiny_train_config(model_dir, data, out, steps=8, checkpoint_every=2, resume=True)
    run = Run(prepare(cfg), Progress("json"))
    with pytest.raises(CheckpointError) as info:
        run.create_actors()
    assert all(str(state) in str(info.value) for state in states)
    assert not hasattr(run, "stores")  # raised before the weight stores were made


def test_compile_blocks_goes_from_the_config_to_the_trainers_engine(model_dir):
    cfg = build_config({}, {"compile_blocks": True})
    settings = trainer_settings(SimpleNamespace(cfg=cfg, device="cpu", dtype="float32"))
    assert settings.compile_blocks
    handles = WeightStore(str(model_dir), "float32").handles()
    engine = Trainer(handles, settings).engine
    assert engine._block is models.compiled_block_forward and engine.kernels == "fast"
    default = TrainerSettings(lora=cfg.lora_spec())
    assert Trainer(handles, default).engine._block is models.block_forward
    fast = build_config({}, {"kernels": "fast"})  # --kernels reaches the engine the same way
    settings = trainer_settings(SimpleNamespace(cfg=fast, device="cpu", dtype="float32"))
    assert Trainer(handles, settings).engine.kernels == "fast"


def test_data_as_it_comes_trains_and_evaluates_with_a_template_by_name(
    ray_local, model_dir, tmp_path
):
    """Alpaca rows in a CSV, ShareGPT with OpenAI's role names, OpenAI content parts: one
    dataset, mixed with a TSV of prompts and completions at weight 2 (--mix-data), rendered with
    --chat-template chatml (the model has no template of its own), trained and validated
    through the actors."""
    said = sentences(40, seed=3)
    pairs = list(zip(said[::2], said[1::2], strict=True))
    data = tmp_path / "mixed"
    data.mkdir()
    (data / "a.csv").write_text(
        "instruction,input,output\n" + "".join(f"{q},{a[:5]},{a}\n" for q, a in pairs[:5])
    )
    (data / "b.jsonl").write_text(
        "".join(
            json.dumps({"conversations": [{"from": "user", "value": q},
                                          {"from": "assistant", "value": a}]}) + "\n"
            for q, a in pairs[5:10]
        )
    )  # fmt: skip
    (data / "c.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": q}]},
                                     {"role": "assistant", "content": a}]}) + "\n"
            for q, a in pairs[10:15]
        )
    )  # fmt: skip
    (tmp_path / "d.tsv").write_text(
        "prompt\tcompletion\n" + "".join(f"{q}\t{a}\n" for q, a in pairs[15:])
    )
    out = tmp_path / "out"
    cfg = tiny_train_config(
        model_dir,
        data,
        out,
        steps=3,
        seq_len=32,
        chat_template="chatml",
        eval_split=0.2,
        mix_data=f"{tmp_path / 'd.tsv'}=2",
    )
    summary = train(cfg, Progress("json"))
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and summary["steps"] == 3
    assert run["config"]["chat_template"] == "chatml"  # a name, not a path made of it
    assert run["config"]["mix_data"] == [f"{tmp_path / 'd.tsv'}=2"]
    assert len(run["data_fingerprint"]["mix"]) == 1  # a resume checks the mixture's files too
    assert all(math.isfinite(x) for x in run["losses"])
    assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] > 0
