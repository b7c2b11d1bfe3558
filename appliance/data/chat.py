"""Conversations: validating chat records, rendering them with the model's chat template, and
finding the characters that are training targets.

The template is the model's own: a `chat_template.jinja` file, else `chat_template` in
`tokenizer_config.json` (a string, or the named list form `[{"name": "default", "template":
...}, ...]`), else in a multimodal model's `chat_template.json`; `--chat-template FILE` overrides
them (a jinja file, or a .json file holding `chat_template` as tokenizer_config.json does). It is
rendered the way transformers renders it:
a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, `raise_exception()` and a
`tojson` filter, and the special tokens (`bos_token`, `eos_token`, ...) of tokenizer_config.json;
`messages` as the record gives them (see `messages_of`) and the record's `tools`.

Targets (the definition the tests and users rely on): let `render(m, gen)` be the rendering of
messages `m` with `add_generation_prompt=gen`. Assistant message k spans the characters
`[len(render(m[:k], True)), len(render(m[:k+1], False)))` of `render(m, False)`, unless it has
`"weight": 0`. A token with offsets `(s, e)` is a target when it shares a character with a span
`[a, b)`: `s < b and a < e` (a token of no characters, `(p, p)`, is one when `a < p < b`). This is
transformers' assistant mask (`return_assistant_tokens_mask`, the turn in `{% generation %}`
tags). So each assistant turn is trained together with the end-of-turn text the template puts
after it, and a token that starts in the generation prompt but ends in the answer (`Ġthe`,
`▁the` after a prompt ending in a space) is trained too; system, user and tool turns and the rest
of the generation prompt are not. A template whose prefixes are not prefixes of the whole
rendering is refused.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.data.templates import NAMED_TEMPLATES, is_template_name
from appliance.errors import ApplianceError, type_name

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's `from` names (both its own and OpenAI's) and the roles they are
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
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

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        where: str | None = None,
    ) -> str:
        """The template's text for `messages` (and the record's `tools`); ChatError naming
        `where` (the record) if the template fails on them."""
        import jinja2

        compiled = _compiled(self.template, self.source)
        at = f"{where}: " if where else ""
        deadline = time.monotonic() + RENDER_SECONDS
        _limits.deadline = deadline  # environment.tick() in every loop of the template checks it
        try:
            parts, size = [], 0
            for part in compiled.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            ):
                size += len(part)
                if size > RENDER_CHARS:
                    raise RenderLimit(f"its text passed {RENDER_CHARS:,} characters")
                if time.monotonic() > deadline:
                    raise RenderLimit(f"it ran past {RENDER_SECONDS:g} s")
                parts.append(part)
            return "".join(parts)
        except RenderLimit as e:  # a template that loops, or writes without end
            raise ChatError(
                f"{at}chat template {self.source} stopped rendering one record: {e} (a loop "
                "that does not end?); fix the template or pass --chat-template FILE"
            ) from None
        except Exception as e:  # a template is a program: whatever it raises, it fails on this
            # record: raise_exception(), or `None + '...'` on a message without content
            problem = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise ChatError(f"{at}chat template {self.source} failed: {problem}") from None
        finally:
            _limits.deadline = None


_CACHE: dict[str, Any] = {}

#: one record's rendering stops past either: a template that loops or writes without end
RENDER_SECONDS = 10.0
RENDER_CHARS = 64 * 2**20
_limits = threading.local()  # the deadline of the rendering on this thread


class RenderLimit(Exception):
    """A rendering that ran past RENDER_SECONDS or RENDER_CHARS."""


def _bounded_environment() -> type:
    """jinja2's immutable sandbox, bounded: every `for` loop of a compiled template calls
    `environment.tick()` on each pass (inserted into the Python jinja generates), which raises
    RenderLimit past the rendering's deadline: a nested `range(100000)` loop, which emits
    nothing and calls nothing, hung the driver. `*` and `**` are checked before they build a
    string, list or number past the limits."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def _generate(self, source: Any, name: Any, filename: Any, defer_init: bool = False):
            code = super()._generate(source, name, filename, defer_init)
            lines = []
            for line in code.splitlines():
                lines.append(line)
                stripped = line.lstrip()
                if stripped.startswith(("for ", "async for ")) and stripped.endswith(":"):
                    indent = line[: len(line) - len(stripped)]
                    lines.append(f"{indent}    environment.tick()")
            return "\n".join(lines)

        def tick(self) -> None:
            deadline = getattr(_limits, "deadline", None)
            if deadline is not None and time.monotonic() > deadline:
                raise RenderLimit(f"it ran past {RENDER_SECONDS:g} s")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * n > RENDER_CHARS:
                            raise RenderLimit(f"`*` would make {len(seq) * n:,} items")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 4096:
                raise RenderLimit(f"`**` with an exponent of {right}")
            return super().call_binop(context, operator, left, right)

    return BoundedEnvironment


def _compiled(template: str, source: str):
    """The compiled jinja2 template (cached per process: workers render thousands of records).
    ChatError naming `source` (where the template came from) and the line when it does not
    compile."""
    if template not in _CACHE:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

        env = _bounded_environment()(
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


def _template_of(value: Any, source: str) -> str:
    """The template a JSON file's `chat_template` value holds: a string, or the named list form,
    whose "default" one is used. ChatError naming `source` otherwise."""
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
    return value


def _override_template(override: str | Path) -> tuple[str, str]:
    """(source, template) of --chat-template FILE: a jinja template, or a .json file holding
    `chat_template` (a tokenizer_config.json, a processor's chat_template.json)."""
    path = Path(override)
    if not path.is_file():
        names = ", ".join(NAMED_TEMPLATES)
        raise ChatError(f"--chat-template {override}: no such file, nor a built-in name ({names})")
    if path.suffix.lower() != ".json":
        return str(path), path.read_text(encoding="utf-8")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatError(f"--chat-template {override}: cannot read as JSON: {e}") from None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if value is None:
        raise ChatError(
            f'--chat-template {override}: a JSON file without "chat_template"; pass a jinja '
            "template file, or a tokenizer_config.json or chat_template.json that holds one"
        )
    source = f"{path} chat_template"
    return source, _template_of(value, source)


def load_chat_template(model_dir: str | Path, override: str | Path | None = None):
    """The model's ChatTemplate, or None when it has none (and no override is given).

    `model_dir` holds tokenizer_config.json (optional) and maybe chat_template.jinja; `override`
    is --chat-template NAME (a built-in template, `templates.NAMED_TEMPLATES`) or FILE: a jinja
    template, or a .json file holding `chat_template`. ChatError naming the file when one cannot
    be read or compiled.
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
    if isinstance(override, str) and is_template_name(override):
        source, template = f"--chat-template {override}", NAMED_TEMPLATES[override]
    elif override is not None:
        source, template = _override_template(override)
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
        template = _template_of(value, source)
    chat = ChatTemplate(source, template, specials)
    _compiled(template, source)  # fail now, naming the template, not in the first worker
    return chat


@dataclass(frozen=True)
class FieldMap:
    """Where a dataset of another shape keeps its conversations (axolotl's keys, the flags of the
    same names): `messages`, the record's key that holds the list of messages
    (`--field-messages`); `role` and `content`, a message's keys for them
    (`--message-property-mappings role=from,content=value`); `roles`, (name, role) pairs: what
    the dataset calls each role (`--roles user=human,assistant=bot`), beside the names known
    already. None: the record's own form decides (messages: role/content, conversations:
    from/value)."""

    messages: str | None = None
    role: str | None = None
    content: str | None = None
    roles: tuple[tuple[str, str], ...] = ()


def messages_of(obj: dict, where: str, fields: FieldMap | None = None) -> list[dict] | None:
    """The messages of a conversation record, as its chat template receives them, or None when
    the record is not a conversation. ChatError naming `where` when it is a bad one.

    OpenAI's form: `{"messages": [{"role": ..., "content": "..."}, ...], "tools": [...]}`. Every
    other key of a message (`tool_calls`, `name`, `tool_call_id`, `reasoning_content`, ...) goes to
    the template as given, as transformers passes it; a key whose value is null is left out (a
    parquet or arrow table gives every message each key of its column). `content` may be null or
    missing on a message with `tool_calls`, and may be a list of OpenAI content parts
    (`[{"type": "text", "text": ...}, ...]`: their texts joined; any other part is refused by its
    type). `weight` (OpenAI's fine-tuning format): 1, the default, trains an assistant turn; 0
    renders it without training it (the record's `tools`: `tools_of`). ShareGPT `conversations`
    (`{"from": "human", "value": "..."}`) are mapped onto role and content (system, human or
    user, gpt or assistant, tool). `fields`: another shape's keys and role names (FieldMap)."""
    fields = fields or FieldMap()
    if fields.messages is not None:
        key = fields.messages
    else:
        key = next((k for k in ("messages", "conversations") if k in obj), None)
    if key is None or key not in obj:
        return None
    raw = obj[key]
    sharegpt = key == "conversations" and fields.messages is None
    role_key = fields.role or ("from" if sharegpt else "role")
    content_key = fields.content or ("value" if sharegpt else "content")
    roles = dict(SHAREGPT_ROLES) if sharegpt or fields.messages or fields.roles else None
    if roles is not None:
        roles.update(fields.roles)
    shape = f'a list of {{"{role_key}": ..., "{content_key}": "..."}} objects'
    if not isinstance(raw, list):
        raise ChatError(f'{where}: "{key}" must be {shape} (found {type_name(raw)})')
    if not raw:
        raise ChatError(
            f'{where}: "{key}" is empty: a conversation needs at least one assistant turn'
        )
    allowed = tuple(roles) if roles else ROLES
    messages = []
    for i, m in enumerate(raw):
        at = f'{where}: "{key}"[{i}]'
        if not isinstance(m, dict) or role_key not in m:
            raise ChatError(f'{at} must be {{"{role_key}", "{content_key}"}}{_keys_hint(m)}')
        role = m[role_key]
        if not isinstance(role, str) or role not in allowed:
            raise ChatError(
                f"{at} has unknown {role_key} {role!r}; expected one of "
                + ", ".join(allowed)
                + " (or name it: --roles user=NAME, assistant=NAME, ...)"
            )
        role = roles[role] if roles else role
        others = {k: v for k, v in m.items() if k not in (role_key, content_key) and v is not None}
        message = {"role": role}
        content = m.get(content_key)
        if content is not None or not others.get("tool_calls"):  # else a turn of tool calls only
            if content_key not in m:
                raise ChatError(f'{at} must be {{"{role_key}", "{content_key}"}}')
            content = _content_text(content, f"{at}.{content_key}")
        if content_key in m:
            message["content"] = content
        message.update(others)
        weight = message.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1):
            raise ChatError(f"{at}.weight must be 0 or 1 (found {json.dumps(weight, default=str)})")
        if weight == 1 and "weight" in message and role != "assistant":
            raise ChatError(
                f"{at}.weight is 1 on a {role} message: only assistant turns are trained"
            )
        messages.append(message)
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        raise ChatError(f"{where}: conversation has no assistant turn: nothing to learn")
    if all(m.get("weight", 1) == 0 for m in assistant):
        raise ChatError(f"{where}: every assistant turn has weight 0: nothing to learn")
    return messages


def _keys_hint(m: Any) -> str:
    """For a message without the keys looked for: the keys it has, and the flag that maps them."""
    if not isinstance(m, dict):
        return f" (found {type_name(m)})"
    keys = ", ".join(json.dumps(k) for k in list(m)[:6])
    return f" (its keys: {keys}; for other names: --message-property-mappings role=KEY,content=KEY)"


def _content_text(content: Any, at: str) -> str:
    """A message's content as text: a string, or OpenAI content parts whose texts are joined
    (`[{"type": "text", "text": "..."}]`). ChatError naming `at` and the part otherwise: a
    non-text part (an image, audio) cannot be trained by a text model."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(
            f"{at} must be a string or a list of text parts (found {type_name(content)})"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            found = f'a "{kind}" part' if isinstance(kind, str) else type_name(part)
            raise ChatError(
                f'{at}[{j}] is {found}: only text parts ({{"type": "text", "text": "..."}}) '
                "can be trained on a text model; drop the part (or the record)"
            )
        if not isinstance(part.get("text"), str):
            raise ChatError(
                f"{at}[{j}].text must be a string (found {type_name(part.get('text'))})"
            )
        texts.append(part["text"])
    return "".join(texts)


def tools_of(obj: dict, where: str) -> list[dict] | None:
    """A conversation record's `tools` for its template: None, or a list of objects; a JSON
    string holding that list is decoded (ShareGPT function-calling sets store it so). ChatError
    naming `where` otherwise."""
    tools = obj.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as e:
            raise ChatError(f'{where}: "tools" is a string that is not JSON ({e})') from None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError(f'{where}: "tools" must be a list of objects (found {type_name(tools)})')
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatError(f'{where}: "tools"[{i}] must be an object (found {type_name(tool)})')
    return tools


def render_with_spans(
    chat: ChatTemplate, messages: list[dict], where: str, tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(render(messages, False), the character span of every assistant turn trained: those
    without `"weight": 0`); see the module doc. `tools`: the record's, handed to the template."""
    full = chat.render(messages, False, tools, where)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        before = chat.render(messages[:k], True, tools, where)
        through = chat.render(messages[: k + 1], False, tools, where)
        if not (full.startswith(before) and full.startswith(through)):
            raise ChatError(
                f"{where}: chat template {chat.source} renders the first {k} message(s) as text "
                "that is not a prefix of the whole conversation, so the assistant turns cannot "
                "be located; use a prefix-stable template (--chat-template FILE)"
            )
        spans.append((len(before), len(through)))
    return full, spans


def target_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token (its character offsets `(s, e)`): does it share a character with an assistant
    span `[a, b)`, `s < b and a < e`? A token of no characters, `(p, p)`, then is one when
    `a < p < b`: inside a turn, not at its edge (transformers' assistant mask; module doc)."""
    return [any(s < b and a < e for a, b in spans) for s, e in offsets]
