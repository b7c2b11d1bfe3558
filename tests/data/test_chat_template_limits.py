"""A chat template's rendering has a time and a size limit, and stops with a one-line error
naming the template (issue 44, item 7): a template that loops
(`{% for i in range(100000) %}{% for j in range(100000) %}…`) hung the driver silently."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.data import chat
from appliance.data.chat import ChatError, ChatTemplate
from tests.helpers_model import make_model

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_template_that_loops_stops_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    template = ChatTemplate("loops.jinja", LOOPS + "{{ messages[0].content }}")
    with pytest.raises(ChatError) as e:
        template.render(MESSAGES, False, where="data.jsonl:1")
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("data.jsonl:1: chat template loops.jinja stopped rendering")
    assert "ran past 0.5 s" in message


@pytest.mark.parametrize(
    "body, said",
    [
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "passed 1,000,000 characters"),
        ("{{ 'x' * 1000000000 }}", "`*` would make 1,000,000,000 items"),
        ("{{ 2 ** 100000000 }}", "`**` with an exponent of 100000000"),
    ],
)
def test_a_template_that_writes_without_end_stops_at_the_size_limit(monkeypatch, body, said):
    monkeypatch.setattr(chat, "RENDER_CHARS", 1_000_000)
    with pytest.raises(ChatError, match="chat template big.jinja stopped rendering") as e:
        ChatTemplate("big.jinja", body).render(MESSAGES, False)
    assert said in str(e.value)


def test_an_ordinary_template_renders_as_before():
    template = ChatTemplate(
        "t.jinja",
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    assert template.render(MESSAGES, True) == "<user>hi<assistant>hello<assistant>"


def test_train_with_a_looping_template_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(5)))
    looping = tmp_path / "loops.jinja"
    looping.write_text(LOOPS + "{% for m in messages %}{{ m.content }}{% endfor %}")
    result = CliRunner().invoke(
        main,
        ["train", "--model", str(model), "--data", str(data), "--output", str(tmp_path / "o"),
         "--chat-template", str(looping)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    assert f"chat template {looping} stopped rendering one record" in errors[0]
