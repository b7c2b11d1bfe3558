"""Chat templates by name, for a model that has none (a base model): `--chat-template chatml`.

Each is the template its model family publishes in `tokenizer_config.json`, character for
character, so that an adapter trained with it on a base model talks as the family's instruct
model does:

    chatml    the ChatML format (Qwen, Hermes; transformers' docs): <|im_start|>user\nHi<|im_end|>\n
    llama3    Meta-Llama-3-8B-Instruct: <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>
    gemma     gemma-7b-it (no system turn): <start_of_turn>user\nHi<end_of_turn>\n
    mistral   Mistral-7B-Instruct-v0.1 (user and assistant only): [INST] Hi [/INST]answer</s>

A template writes its markers as text (`<|im_start|>`): a tokenizer that holds them as special
tokens encodes each as one token, and one that does not (most base models) as several; either
way every marker of an assistant turn is trained, so the adapter learns to end its turns.
"""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

NAMED_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "gemma": GEMMA,
    "mistral": MISTRAL,
}


def is_template_name(value: str | None) -> bool:
    """Whether `--chat-template VALUE` names a built-in template rather than a file (a file
    named like one is given as a path: ./chatml)."""
    return value in NAMED_TEMPLATES
