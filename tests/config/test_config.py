"""The typed config: one schema for YAML keys and flags; every error at once, naming the flag."""

from __future__ import annotations

import dataclasses

import pytest

from appliance import config as C
from appliance.errors import ConfigError


def test_defaults_are_valid_and_file_then_flags_override():
    cfg = C.build_config({"seq_len": 512, "lora_rank": 8}, {"seq_len": 1024})
    assert (cfg.seq_len, cfg.lora_rank, cfg.micro_batch_size) == (1024, 8, 4)


def test_yaml_keys_may_use_hyphens_and_values_are_coerced_to_the_field_type():
    cfg = C.build_config(
        {"micro-batch-size": "2", "lr": "1e-3", "resume": "yes", "lora_targets": "q, v"},
        {"output": "/o"},
    )
    assert cfg.micro_batch_size == 2 and cfg.lr == 1e-3 and cfg.resume is True
    assert cfg.lora_targets == ("q", "v")
    assert cfg.lora_spec().modules == ["self_attn.q_proj", "self_attn.v_proj"]


def test_every_problem_is_reported_together_naming_the_flag_or_the_file_and_key():
    with pytest.raises(ConfigError) as e:
        C.build_config(
            {"lora_rnk": 1, "lora_dropout": 1.5, "steps": 2.5},
            {"epochs": 1, "lora_targets": "q,zz", "log_format": "xml"},
            source="--config run.yaml",
        )
    lines = str(e.value).splitlines()
    assert sorted(lines) == sorted(
        [
            "--config run.yaml: unknown key 'lora_rnk' (did you mean 'lora_rank'?)",
            "--config run.yaml: lora_dropout must be in [0, 1) (got 1.5)",
            "--config run.yaml: steps: 2.5 is not a valid int",
            "--lora-targets: zz not among q,k,v,o,gate,up,down,qkv,gate_up,experts,in_proj_qkv,"
            "in_proj_z,in_proj_b,in_proj_a,out_proj,shared_gate,shared_up,shared_down",
            "--log-format must be one of auto | rich | json | plain (got 'xml')",
        ]
    )


def test_flag_values_arrive_as_strings_and_every_bad_one_is_reported():
    with pytest.raises(ConfigError) as e:
        C.build_config({}, {"seq_len": "abc", "lr": "x", "lora_rank": "0", "steps": "5"})
    assert str(e.value).splitlines() == [
        "--seq-len: 'abc' is not a valid int",
        "--lr: 'x' is not a valid float",
        "--lora-rank must be ≥ 1 (got 0)",
    ]
    cfg = C.build_config({}, {"seq_len": "32", "lr": "1e-3", "device": "cpu", "steps": "5"})
    assert (cfg.seq_len, cfg.lr, cfg.device, cfg.steps) == (32, 1e-3, "cpu", 5)


def test_a_flag_overrides_the_file_and_is_named_instead_of_it():
    with pytest.raises(ConfigError) as e:
        C.build_config({"lora_rank": 0, "seq_len": 0}, {"seq_len": "-1"}, source="--config f")
    assert sorted(str(e.value).splitlines()) == [
        "--config f: lora_rank must be ≥ 1 (got 0)",
        "--seq-len must be ≥ 1 (got -1)",
    ]


def test_steps_and_epochs_are_exclusive_and_model_needs_data_and_output():
    with pytest.raises(ConfigError, match="--steps and --epochs are exclusive"):
        C.build_config({}, {"model": "/m", "data": "/d", "output": "/o", "steps": 3, "epochs": 1})
    with pytest.raises(ConfigError, match="--data is required with --model"):
        C.build_config({}, {"model": "/m", "output": "/o"})
    with pytest.raises(ConfigError, match="--resume and --overwrite are exclusive"):
        C.build_config({}, {"resume": True, "overwrite": True})
    # a resume names the run's output: not the demo's new temp dir, which holds no run
    with pytest.raises(ConfigError, match=r"^--resume needs --output DIR: the output of the run"):
        C.build_config({}, {"resume": True})
    for other in ("resume", "overwrite"):
        with pytest.raises(ConfigError, match=f"--auto-resume and --{other} are exclusive"):
            C.build_config({}, {"auto_resume": True, other: True})


def test_without_a_model_the_demo_settings_sit_below_the_file_and_the_flags():
    demo = C.build_config({}, {})
    assert {k: getattr(demo, k) for k in C.DEMO_SETTINGS} == C.DEMO_SETTINGS
    assert demo.model is None and demo.epochs is None
    # a flag equal to the plain default still wins over the demo's value
    cfg = C.build_config({"lr": 0.01}, {"seq_len": "256"})
    assert (cfg.seq_len, cfg.lr, cfg.micro_batches_per_step) == (256, 0.01, 2)
    # choosing the run's length (either way) replaces the demo's 300 steps
    cfg = C.build_config({}, {"epochs": "1"})
    assert (cfg.steps, cfg.epochs) == (None, 1)
    cfg = C.build_config({"steps": 7}, {})
    assert (cfg.steps, cfg.epochs) == (7, None)


def test_with_a_model_the_demo_settings_do_not_apply():
    for file_values, flags in (({"model": "/m"}, {}), ({}, {"model": "/m"})):
        cfg = C.build_config(file_values, {**flags, "data": "/d", "output": "/o"})
        assert (cfg.steps, cfg.seq_len, cfg.lr) == (None, 256, 2e-4)


def test_data_without_a_model_is_refused_naming_both_flags():
    with pytest.raises(ConfigError) as e:
        C.build_config({}, {"data": "mine.jsonl"})
    (line,) = str(e.value).splitlines()
    assert line.startswith("--data needs --model")
    with pytest.raises(ConfigError, match="--cluster needs --model"):
        C.build_config({}, {"cluster": "auto"})


@pytest.mark.parametrize(
    "text,expected",
    [("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000)],
)
def test_sizes_parse_with_binary_and_decimal_units(text, expected):
    assert C.parse_bytes(text) == expected


def test_a_bad_size_names_the_flag():
    with pytest.raises(ConfigError, match="--gpu-memory-budget: 'lots' is not a size"):
        C.build_config({}, {"gpu_memory_budget": "lots"})


PATHS = {"model": "/m", "data": "/d", "output": "/o"}
NOT_OPTIONAL = [f.name for f in dataclasses.fields(C.TrainConfig) if f.default is not None]


@pytest.mark.parametrize("name", NOT_OPTIONAL)
def test_null_in_the_file_for_a_key_that_has_a_value_is_one_error_naming_file_and_key(name):
    """`lr: null` (YAML's null, or an empty `lr:`) is no value for a key whose default is one:
    one line naming the file and key, what to give, and that leaving it out gives the default;
    not a TypeError from validate or the type conversion, not None used silently."""
    with pytest.raises(ConfigError) as e:
        C.build_config({name: None}, PATHS, source="--config c.yaml")
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"--config c.yaml: {name}: null is not a value; give ")
    assert line.endswith(", or leave the key out for the default (" + _shown(name) + ")")


def _shown(name: str) -> str:
    default = C.FIELDS[name].default
    if isinstance(default, bool):
        return str(default).lower()
    return ",".join(default) if isinstance(default, tuple) else str(default)


def test_a_null_names_the_value_leaving_the_key_out_gives_and_what_to_give():
    with pytest.raises(ConfigError) as e:  # the demo's defaults, the key as the file spells it
        C.build_config({"lr": None, "seq-len": None, "log_format": None}, {}, source="--config c")
    assert str(e.value).splitlines() == [
        "--config c: lr: null is not a value; give a number, or leave the key out for the "
        "default (0.003)",
        "--config c: seq-len: null is not a value; give an integer, or leave the key out for "
        "the default (64)",
        "--config c: log_format: null is not a value; give one of auto | rich | json | plain, "
        "or leave the key out for the default (auto)",
    ]
    with pytest.raises(ConfigError) as e:  # resuming: the recorded run's value
        C.build_config({"lr": None}, PATHS, run_values={"lr": 1e-3}, run_source="o/run.json")
    assert str(e.value) == (
        "config file: lr: null is not a value; give a number, or leave the key out for "
        "o/run.json's value (0.001)"
    )


def test_null_for_an_optional_key_is_the_key_left_out():
    cfg = C.build_config({"steps": None, "eval_data": None, "chat_template": None}, {})
    assert (cfg.steps, cfg.eval_data, cfg.chat_template) == (300, None, None)  # the demo's
    cfg = C.build_config({"eval_data": None}, PATHS, run_values={"eval_data": "/held"})
    assert cfg.eval_data == "/held"


def test_every_field_has_help_text_for_the_cli():
    for f in C.FIELDS.values():
        assert f.metadata["help"].strip(), f.name


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        C.read_config_file(path)
    with pytest.raises(ConfigError, match="file not found"):
        C.read_config_file(tmp_path / "missing.yaml")


def test_a_missing_example_config_names_the_packaged_one(tmp_path, monkeypatch):
    """The configs' headers say `--config appliance/configs/X.yaml`, a path of the repository: in
    the image (working directory /home/appliance) or an installed package it is not there, and
    the error gives the path that is."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        C.read_config_file("appliance/configs/llama2-7b-a10.yaml")
    msg = str(e.value)
    assert msg.startswith(
        f"--config appliance/configs/llama2-7b-a10.yaml: file not found (relative to {tmp_path})"
    )
    packaged = msg.split("ships with the package: --config ")[1].removesuffix(")")
    assert C.read_config_file(packaged)["seq_len"] == 2048
    with pytest.raises(ConfigError) as e:
        C.read_config_file(tmp_path / "mine.yaml")
    assert str(e.value) == f"--config {tmp_path / 'mine.yaml'}: file not found"


def test_a_run_recorded_before_packing_and_quantization_resumes_as_it_was(tmp_path):
    """A run.json written before `packing`, `base_quant` and `eval_split` were part of a run:
    `--output O --resume` alone continues it as it ran (documents packed as one stream), and a
    command that asks for document packing is refused, naming both values."""
    import json

    from appliance.run.record import LEGACY_IDENTITY, RUN_FILE, run_identity
    from appliance.run.resume import decide_output, recorded_config

    out = tmp_path / "out"
    out.mkdir()
    old = C.build_config({}, {"model": "m", "data": "d", "output": str(out), "packing": "stream"})
    record = {"identity": run_identity(old), "config": old.to_dict(), "status": "interrupted"}
    for key in LEGACY_IDENTITY:  # what an older appliance did not write
        del record["identity"][key], record["config"][key]
    (out / RUN_FILE).write_text(json.dumps(record))

    resumed = C.build_config(
        {}, {"output": str(out), "resume": True}, run_values=recorded_config(str(out))
    )
    assert (resumed.packing, resumed.base_quant, resumed.eval_split) == ("stream", "none", None)
    decide_output(resumed)  # the same run: no error

    asked = C.build_config({}, {"model": "m", "data": "d", "output": str(out), "resume": True})
    with pytest.raises(ConfigError, match="--packing documents \\(the run: stream\\)"):
        decide_output(asked)
    # --auto-resume (a Kubernetes job's rerun) with another run's flags is refused the same way,
    # naming the flag it was given and how to start another run instead
    auto = C.build_config({}, {"model": "m", "data": "d", "output": str(out), "auto_resume": True})
    with pytest.raises(ConfigError) as e:
        decide_output(auto)
    assert str(e.value).startswith(f"--auto-resume: {out} holds a run with different --packing")
    assert str(e.value).endswith("give another --output (or --overwrite this one)")


def test_a_resume_checks_its_data_follows_it_when_moved_and_names_what_changed(
    tmp_path, monkeypatch
):
    """run.json's data fingerprint: a resume on the same files goes on, the same files at a new
    path are followed, and an added, removed or edited file is refused by name unless
    --allow-data-change (which is then said in a note). Without the flag nothing else passes."""
    import json
    import shutil

    from appliance.data.records import check_dataset
    from appliance.run.record import RUN_FILE, data_fingerprint, write_run_file
    from appliance.run.resume import decide_output

    data, out = tmp_path / "data", tmp_path / "out"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"text": "one"}\n' * 3)
    (data / "sub" / "b.jsonl").write_text('{"text": "two"}\n' * 20000)  # sampled, not read whole
    (out / "checkpoints" / "step-000002").mkdir(parents=True)  # (without one, no cursor to keep)
    (out / "checkpoints" / "step-000002" / "manifest.json").write_text("{}")

    def fingerprint(path):
        return data_fingerprint(path, check_dataset(path))

    def config(path, **flags):
        return C.build_config({}, {"model": "m", "data": str(path), "output": str(out), **flags})

    def resumed(path, **flags):
        return list(
            decide_output(config(path, resume=True, **flags), None, fingerprint(path)).notes
        )

    write_run_file(config(data), "interrupted", data=fingerprint(data))
    assert resumed(data) == []  # the same files
    moved = shutil.move(data, tmp_path / "moved")
    assert resumed(moved) == []  # followed: run.json records the new path from the next write
    with pytest.raises(ConfigError, match=r"--data \S+ \(the run: \S+/data\)"):
        resumed(moved / "a.jsonl")  # another path, other files: another run's data
    shutil.move(moved, data)

    (data / "c.jsonl").write_text('{"text": "three"}\n')
    (data / "a.jsonl").write_text('{"text": "One"}\n' * 3)  # the same size, other bytes
    big = (data / "sub" / "b.jsonl").read_bytes()
    (data / "sub" / "b.jsonl").write_bytes(big[: len(big) // 2])
    with pytest.raises(ConfigError) as e:
        resumed(data)
    assert str(e.value).startswith(
        f"--resume: --data {data} changed since the run started: 1 file(s) added (c.jsonl); "
        "2 file(s) changed (a.jsonl, sub/b.jsonl: 320,000 → 160,000 bytes). The run's data "
        "cursors count documents in its files as they were"
    )
    assert "--allow-data-change" in str(e.value)
    (data / "c.jsonl").unlink()
    (data / "sub" / "b.jsonl").unlink()
    with pytest.raises(ConfigError, match="1 file\\(s\\) removed \\(sub/b.jsonl\\)"):
        resumed(data)
    [note] = resumed(data, allow_data_change=True)
    assert note == (
        f"--data {data} changed since the run started: 1 file(s) removed (sub/b.jsonl); 1 "
        "file(s) changed (a.jsonl); continuing on it, as --allow-data-change asks"
    )
    with pytest.raises(ConfigError, match="--allow-data-change goes with --resume or --auto"):
        C.build_config({}, {"model": "m", "data": "d", "output": "o", "allow_data_change": True})
    # a corpus of more files than run.json names: their number, and 4 KiB of each
    from appliance.run import record as run_record

    monkeypatch.setattr(run_record, "NAMED_DATA_FILES", 1)
    (data / "sub" / "b.jsonl").write_bytes(big)
    write_run_file(config(data), "interrupted", data=fingerprint(data))
    assert json.loads((out / RUN_FILE).read_text())["data_fingerprint"]["files"] is None
    assert resumed(data) == []
    (data / "c.jsonl").write_text('{"text": "three"}\n')
    with pytest.raises(ConfigError, match="changed since the run started: 2 files then, 3 now"):
        resumed(data)
    (data / "c.jsonl").unlink()
    (data / "a.jsonl").write_text('{"text": "one"}\n' * 3)  # within the 4 KiB hashed
    with pytest.raises(ConfigError, match=r"the same number of files \(2\), and some of"):
        resumed(data)
    # a run.json from before data fingerprints: the data is known by its path alone
    record = json.loads((out / RUN_FILE).read_text())
    del record["data_fingerprint"]
    (out / RUN_FILE).write_text(json.dumps(record))
    assert resumed(data) == []


def test_a_resume_on_a_model_changed_in_place_is_refused_unless_allowed(tmp_path):
    """run.json's model fingerprint was only read when the model's path changed: a model
    rewritten at the same path (a new revision downloaded over it, a re-uploaded s3:// prefix)
    was resumed on without a word, and the adapter went on learning against other weights (and
    run.json then recorded the new ones, so eval and export said nothing either)."""
    from safetensors.torch import load_file, save_file

    from appliance.run.record import model_fingerprint, write_run_file
    from appliance.run.resume import decide_output
    from tests.helpers_model import make_model

    model, out, other = make_model(tmp_path / "m", "llama-mha"), tmp_path / "out", tmp_path / "o"
    (out / "checkpoints" / "step-000002").mkdir(parents=True)  # a checkpoint to keep
    (out / "checkpoints" / "step-000002" / "manifest.json").write_text("{}")

    def config(path, **flags):
        return C.build_config({}, {"model": str(path), "data": "d", "output": str(out), **flags})

    def resumed(path, **flags):
        return list(
            decide_output(config(path, resume=True, **flags), model_fingerprint(str(path))).notes
        )

    write_run_file(config(model), "interrupted", fingerprint=model_fingerprint(str(model)))
    assert resumed(model) == []  # as it was
    weights = model / "model.safetensors"  # every weight × 1.5: the same names and shapes
    save_file({k: v * 1.5 for k, v in load_file(weights).items()}, weights, {"format": "pt"})
    with pytest.raises(ConfigError) as e:
        resumed(model)
    assert str(e.value).startswith(
        f"--resume: --model {model} changed since the run started: its files (config.json, "
        "tokenizer or weights) differ from the run's record of them, so its adapter would go on"
    )
    assert "--allow-model-change" in str(e.value)
    assert resumed(model, allow_model_change=True) == [
        f"--model {model} changed since the run started: its files (config.json, tokenizer or "
        "weights) differ from the run's record of them; continuing on it, as "
        "--allow-model-change asks"
    ]
    make_model(other, "llama-mha", seed=1)  # another model, at another path
    with pytest.raises(ConfigError, match=r"holds a run with different --model"):
        resumed(other)
    assert resumed(other, allow_model_change=True) == [
        f"--model {other} is not the run's model ({model}); continuing on it, as "
        "--allow-model-change asks"
    ]
    with pytest.raises(ConfigError, match="--allow-model-change goes with --resume"):
        config(model, allow_model_change=True)


def test_a_resume_on_a_changed_eval_data_goes_on_and_says_so(tmp_path):
    """--eval-data is not what the run trains on: a resume with its files changed goes on, and
    a note says the validation losses from then on compare with the earlier ones no more."""
    from appliance.data.records import check_dataset
    from appliance.run.record import data_fingerprint, write_run_file
    from appliance.run.resume import decide_output

    data, held_out, out = tmp_path / "d.jsonl", tmp_path / "eval", tmp_path / "out"
    data.write_text('{"text": "one"}\n')
    held_out.mkdir()
    (held_out / "a.jsonl").write_text('{"text": "two"}\n')
    out.mkdir()

    def fingerprint(path):
        return data_fingerprint(path, check_dataset(path))

    cfg = {"model": "m", "data": str(data), "output": str(out), "eval_data": str(held_out)}
    write_run_file(C.build_config({}, cfg), "interrupted", None, None, fingerprint(data),
                   fingerprint(held_out))  # fmt: skip

    def resumed(**flags):
        resume = C.build_config({}, {**cfg, "resume": True, **flags})
        return list(decide_output(resume, None, fingerprint(data), fingerprint(held_out)).notes)

    assert resumed() == []
    (held_out / "b.jsonl").write_text('{"text": "three"}\n')
    assert resumed() == [
        f"--eval-data {held_out} changed since the run started: 1 file(s) added (b.jsonl); "
        "validation losses from here on are on the files as they are now, not comparable with "
        "the run's earlier ones"
    ]
    data.write_text('{"text": "One"}\n')  # with the training data changed too, both are said
    notes = resumed(allow_data_change=True)
    assert len(notes) == 2 and notes[1].startswith(f"--eval-data {held_out} changed"), notes
    assert resumed(eval_data=str(held_out / "b.jsonl"), allow_data_change=True)[1:] == []


def test_a_resume_with_other_training_settings_says_so(tmp_path):
    """--lr, --dtype, ... may change on a resume (they are not what the run is), but never
    silently: a note names each, with the run's value."""
    import json

    from appliance.run.record import write_run_file
    from appliance.run.resume import decide_output

    out = tmp_path / "out"
    out.mkdir()
    cfg = {"model": "m", "data": "d", "output": str(out), "dtype": "float32"}
    write_run_file(C.build_config({}, cfg), "interrupted")
    run = json.loads((out / "run.json").read_text())["config"]

    def resumed(**flags):
        cfg = C.build_config({}, {"output": str(out), "resume": True, **flags}, run_values=run)
        return list(decide_output(cfg).notes)

    assert resumed() == []
    assert resumed(lr="0.5", dtype="bfloat16") == [
        "--resume with --lr 0.5 (the run's: 0.0002); --dtype bfloat16 (the run's: float32): the "
        "steps from here on train with these, and the run's record and model card say so"
    ]
    assert resumed(steps="9", log_format="json") == []  # not how the steps train


@pytest.mark.parametrize(
    "budget, message",
    [
        ("0", "--gpu-memory-budget 0 leaves nothing to plan"),
        ("24", "--gpu-memory-budget 24 is 24 bytes: did you mean 24GiB?"),
    ],
)
def test_train_refuses_the_budget_plan_refuses(budget, message):
    """`train --gpu-memory-budget 0` was no cap at all, and `24` 24 bytes: refused as plan
    refuses them, naming the flag."""
    with pytest.raises(ConfigError, match=message):
        C.build_config({}, {"model": "m", "data": "d", "output": "o", "gpu_memory_budget": budget})
    C.build_config({}, {"model": "m", "data": "d", "output": "o", "gpu_memory_budget": "20GiB"})


def test_eval_or_export_with_another_model_than_the_runs_says_so(tmp_path):
    """The adapter's run recorded its model's fingerprint: a --model of the same shapes but
    other weights (another seed: a base model and its chat fine-tune) gets a note; the run's
    own model, moved, none; a checkpoint finds the run's record two levels up."""
    import json
    import shutil

    from appliance.run.record import model_fingerprint, other_model_note
    from tests.helpers_model import make_model

    trained = make_model(tmp_path / "a", "llama-mha", seed=0)
    other = make_model(tmp_path / "b", "llama-mha", seed=1)
    out = tmp_path / "out"
    step = out / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    record = {"config": {"model": str(trained)}, "model_fingerprint": model_fingerprint(trained)}
    (out / "run.json").write_text(json.dumps(record))
    moved = shutil.copytree(trained, tmp_path / "moved")
    for adapter in (out, step):
        assert other_model_note(adapter, moved, str(moved)) is None
        assert other_model_note(adapter, other, str(other)) == (
            f"--model {other} is not the model the adapter's run trained ({trained}): their "
            "files differ (config, tokenizer or weights), so the adapter meets other weights "
            "than it learned on"
        )
    assert other_model_note(tmp_path / "peft", other, str(other)) is None  # nothing recorded


def test_full_finetuning_refuses_a_quantized_base_float16_and_stray_freeze_in_one_line_each():
    base = {"model": "m", "data": "d", "output": "o"}
    cfg = C.build_config({"finetuning_type": "full", "freeze_embeddings": True}, base)
    assert (cfg.finetuning_type, cfg.freeze_embeddings) == ("full", True)
    assert C.build_config({}, base).finetuning_type == "lora"  # LoRA stays the default
    with pytest.raises(ConfigError) as e:
        C.build_config(
            {"finetuning_type": "full"}, {**base, "base_quant": "nf4", "dtype": "float16"}
        )
    assert str(e.value).splitlines() == [
        "config file: finetuning_type full trains every weight, and a quantized base "
        "(--base-quant nf4) cannot be trained: use --base-quant none, or --finetuning-type lora "
        "for QLoRA",
        "config file: finetuning_type full has no float16 loss scaling for weight gradients: "
        "use --dtype bfloat16 or float32",
    ]
    with pytest.raises(ConfigError, match="^--freeze-embeddings goes with --finetuning-type full$"):
        C.build_config({}, {**base, "freeze_embeddings": True})


def test_resuming_a_full_finetune_as_lora_is_refused_naming_both(tmp_path):
    import json

    from appliance.run.record import write_run_file
    from appliance.run.resume import decide_output

    out = tmp_path / "out"
    out.mkdir()
    write_run_file(C.build_config({}, {"model": "m", "data": "d", "output": str(out),
                                       "finetuning_type": "full"}), "interrupted")  # fmt: skip
    run = json.loads((out / "run.json").read_text())["config"]
    flags = {"output": str(out), "resume": True, "finetuning_type": "lora"}
    with pytest.raises(ConfigError, match="--finetuning-type lora \\(the run: full\\)"):
        decide_output(C.build_config({}, flags, run_values=run))
