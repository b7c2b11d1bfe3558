"""Conversations: validating chat records, rendering them with the model's chat template, and
finding the characters that are training targets.

The template is the model's own: a `chat_template.jinja` file, else `chat_template` in
`tokenizer_config.json` (a string, or the named list form `[{"name": "default", "template":
...}, ...]`), else in a multimodal model's `chat_template.json`; `--chat-template FILE` overrides
them. It is rendered the way transformers renders it:
a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, `raise_exception()` and a
`tojson` filter, and the special tokens (`bos_token`, `eos_token`, ...) of tokenizer_config.json.

Targets (the definition the tests and users rely on): let `render(m, gen)` be the rendering of
messages `m` with `add_generation_prompt=gen`. Assistant message k spans the characters
`[len(render(m[:k], True)), len(render(m[:k+1], False)))` of `render(m, False)`; a token is a
target when its start offset lies inside a span. So each assistant turn is trained together with
the end-of-turn text the template puts after it; system, user and tool turns and the generation
prompt are not. A template whose prefixes are not prefixes of the whole rendering is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ApplianceError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # {"chat_template": ...}, beside a processor
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatError(ApplianceError):
    """A chat record or template problem; one message argument so that it pickles."""


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and the special tokens it may use. Plain data: it pickles, so the
    driver resolves it once and hands it to every tokenizer worker."""

    source: str  # where the template came from, for messages (a file, or file:key)
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages`; ChatError if the template fails."""
        import jinja2

        try:
            return _compiled(self.template, self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ChatError(f"chat template {self.source} failed: {e}") from None


_CACHE: dict[str, Any] = {}


def _compiled(template: str, source: str):
    """The compiled jinja2 template (cached per process: workers render thousands of records).
    ChatError naming `source` (where the template came from) and the line when it does not
    compile."""
    if template not in _CACHE:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        # No `strftime_now` (transformers has one): a rendering must not depend on the day, or a
        # run resumed tomorrow would tokenize its documents differently. Templates that test
        # `strftime_now is defined` (Llama 3.x) fall back to their fixed date.
        try:
            _CACHE[template] = env.from_string(template)
        except TemplateSyntaxError as e:
            raise ChatError(
                f"chat template {source} does not compile, at its line {e.lineno}: {e.message}"
            ) from None
        except TemplateError as e:
            raise ChatError(f"chat template {source} does not compile: {e}") from None
    return _CACHE[template]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | Path, override: str | Path | None = None):
    """The model's ChatTemplate, or None when it has none (and no override is given).

    `model_dir` holds tokenizer_config.json (optional) and maybe chat_template.jinja; `override`
    is --chat-template FILE. ChatError naming the file when one cannot be read or compiled.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatError(f"cannot read {config_path}: {e}") from None
    specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ChatError(f"--chat-template {override}: no such file")
        source, template = str(path), path.read_text(encoding="utf-8")
    elif (model_dir / TEMPLATE_FILE).is_file():
        source = str(model_dir / TEMPLATE_FILE)
        template = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    else:
        value = config.get("chat_template")
        source = f"{config_path} chat_template"
        processor = model_dir / PROCESSOR_TEMPLATE_FILE
        if value is None and processor.is_file():  # a multimodal model's processor template
            try:
                value = json.loads(processor.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError, AttributeError) as e:
                raise ChatError(f"cannot read {processor}: {e}") from None
            source = f"{processor} chat_template"
        if value is None:
            return None
        if isinstance(value, list):  # the named form: use the "default" one
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
            if value is None:
                raise ChatError(
                    f"{source} is a list of named templates without a 'default' one "
                    f"(found {sorted(str(n) for n in named)}); pass --chat-template FILE"
                )
        if not isinstance(value, str):
            raise ChatError(f"{source} must be a string or a list of named templates")
        template = value
    chat = ChatTemplate(source, template, specials)
    _compiled(template, source)  # fail now, naming the template, not in the first worker
    return chat


def messages_of(obj: dict, where: str) -> list[dict] | None:
    """The OpenAI-style messages of a record (ShareGPT `conversations` mapped onto them), or None
    when the record is not a conversation. ChatError naming `where` when it is a bad one."""
    if "messages" in obj:
        raw, key, role_key, content_key, roles = (
            obj["messages"],
            "messages",
            "role",
            "content",
            None,
        )
    elif "conversations" in obj:
        raw, key, role_key, content_key = obj["conversations"], "conversations", "from", "value"
        roles = SHAREGPT_ROLES
    else:
        return None
    shape = f'a list of {{"{role_key}": ..., "{content_key}": "..."}} objects'
    if not isinstance(raw, list) or not raw:
        raise ChatError(f'{where}: "{key}" must be {shape} (found {type(raw).__name__})')
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise ChatError(f'{where}: "{key}"[{i}] must be {{"{role_key}", "{content_key}"}}')
        role, content = m[role_key], m[content_key]
        allowed = tuple(roles) if roles else ROLES
        if role not in allowed:
            raise ChatError(
                f'{where}: "{key}"[{i}] has unknown {role_key} {role!r}; expected one of '
                + ", ".join(allowed)
            )
        if not isinstance(content, str):
            raise ChatError(
                f'{where}: "{key}"[{i}].{content_key} must be a string '
                f"(found {type(content).__name__})"
            )
        messages.append({"role": roles[role] if roles else role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"{where}: conversation has no assistant turn: nothing to learn")
    return messages


def render_with_spans(
    chat: ChatTemplate, messages: list[dict], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """(render(messages, False), the character span of every assistant turn); see module doc."""
    full = chat.render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat.render(messages[:k], True)
        through = chat.render(messages[: k + 1], False)
        if not (full.startswith(before) and full.startswith(through)):
            raise ChatError(
                f"{where}: chat template {chat.source} renders the first {k} message(s) as text "
                "that is not a prefix of the whole conversation, so the assistant turns cannot "
                "be located; use a prefix-stable template (--chat-template FILE)"
            )
        spans.append((len(before), len(through)))
    return full, spans


def target_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: does its start offset lie inside an assistant span?"""
    return [any(a <= start < b for a, b in spans) for start, _ in offsets]
