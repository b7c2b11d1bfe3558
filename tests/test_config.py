"""The typed config: one schema for YAML keys and flags; every error at once, naming the flag."""

from __future__ import annotations

import pytest

from appliance import config as C
from appliance.errors import ConfigError


def test_defaults_are_valid_and_file_then_flags_override():
    cfg = C.build_config({"seq_len": 512, "lora_rank": 8}, {"seq_len": 1024})
    assert (cfg.seq_len, cfg.lora_rank, cfg.micro_batch_size) == (1024, 8, 4)


def test_yaml_keys_may_use_hyphens_and_values_are_coerced_to_the_field_type():
    cfg = C.build_config(
        {"micro-batch-size": "2", "lr": "1e-3", "resume": "yes", "lora_targets": "q, v"}
    )
    assert cfg.micro_batch_size == 2 and cfg.lr == 1e-3 and cfg.resume is True
    assert cfg.lora_targets == ("q", "v")
    assert cfg.lora_spec().modules == ["self_attn.q_proj", "self_attn.v_proj"]


def test_every_problem_is_reported_together_each_naming_its_flag():
    with pytest.raises(ConfigError) as e:
        C.build_config(
            {"lerning_rate": 1, "lora_dropout": 1.5, "steps": 2.5},
            {"epochs": 1, "lora_targets": "q,zz", "log_format": "xml"},
        )
    lines = str(e.value).splitlines()
    assert any("unknown key 'lerning_rate'" in line for line in lines)
    assert any(line.startswith("--lora-dropout must be in [0, 1)") for line in lines)
    assert any(line.startswith("--steps: 2.5 is not a valid int") for line in lines)
    assert any(line.startswith("--lora-targets: zz not among") for line in lines)
    assert any(line.startswith("--log-format must be one of") for line in lines)
    assert len(lines) == 5


def test_steps_and_epochs_are_exclusive_and_model_needs_data_and_output():
    with pytest.raises(ConfigError, match="--steps and --epochs are exclusive"):
        C.build_config({}, {"steps": 3, "epochs": 1})
    with pytest.raises(ConfigError, match="--data is required with --model"):
        C.build_config({}, {"model": "/m", "output": "/o"})


@pytest.mark.parametrize(
    "text,expected",
    [("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000)],
)
def test_sizes_parse_with_binary_and_decimal_units(text, expected):
    assert C.parse_bytes(text) == expected


def test_a_bad_size_names_the_flag():
    with pytest.raises(ConfigError, match="--gpu-memory-budget: 'lots' is not a size"):
        C.build_config({}, {"gpu_memory_budget": "lots"})


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
