"""Help a newcomer can read: train's flags in groups, every option of eval, plan and doctor
explained, --version."""

from __future__ import annotations

import re

from click.testing import CliRunner

from appliance import config as C
from appliance.cli.main import main


def help_of(*argv: str) -> str:
    result = CliRunner().invoke(main, [*argv, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


def test_train_help_lists_every_flag_once_in_its_group():
    text = help_of("train")
    titles = [t for t in C.HELP_GROUPS if f"\n{t}:\n" in text]
    assert titles == list(C.HELP_GROUPS)  # every group shown, in order
    sections = dict(re.findall(r"\n([A-Z][\w ]+):\n((?:  .*\n|\n(?!\S))*)", text))
    for title, names in C.HELP_GROUPS.items():
        for name in names:
            assert f"--{name.replace('_', '-')} " in sections[title], (title, name)
    for name in C.FIELDS:
        flag = name.replace("_", "-")  # whole: --data is not --data-weight
        assert len(re.findall(rf"^  --{flag}(?![\w-])", text, re.MULTILINE)) == 1, flag
    assert "time-based" in text  # the --checkpoint-every default, said


def test_eval_help_explains_every_option_and_version_is_printed():
    text = help_of("eval")
    command = main.commands["eval"]
    for param in command.params:
        assert param.help, param.name  # type: ignore[attr-defined]
        assert param.help.split()[0] in text  # type: ignore[attr-defined]
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and re.match(r"appliance, version \d", result.output)


def test_plan_and_doctor_explain_every_option_and_list_the_choices():
    for name in ("plan", "doctor"):
        text = help_of(name)
        for param in main.commands[name].params:
            assert param.help, (name, param.name)  # type: ignore[attr-defined]
    text = help_of("plan")
    assert "--gpu [a10|a10g|4090|l4|l40s|a100|h100|h200]" in text
    assert "--base-quant [none|int8|nf4]" in text
    assert "--dtype [float32|bfloat16|float16]" in text
    assert "--micro-batches-per-step [N|auto]" in text
    assert "Exits 1 when the run does not fit" in " ".join(text.split())
    assert "--device [auto|cpu|cuda]" in help_of("doctor")


def test_train_micro_batches_per_step_says_it_takes_auto():
    assert re.search(r"^  --micro-batches-per-step \[N\|auto\]", help_of("train"), re.MULTILINE)
