"""Datasets as they come: Alpaca records, ShareGPT with OpenAI's role names, OpenAI content
parts, CSV and TSV files, and another shape mapped by --field-messages,
--message-property-mappings and --roles (axolotl's keys) each give the very batches of the
same data written in the native form; the built-in chat templates render as their models
publish them; every bad record is one line naming its file and line."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import transformers

from appliance.actors.tokenize_worker import TokenizeWorker
from appliance.adapter.evaluate import evaluate
from appliance.config import build_config
from appliance.data.chat import ChatTemplate, FieldMap, load_chat_template
from appliance.data.templates import NAMED_TEMPLATES
from appliance.errors import ConfigError, DataError
from tests.helpers_model import make_model
from tests.helpers_tokenizer import make_chat_tokenizer

CONVERSATIONS = [
    [
        {"role": "system", "content": "the sun"},
        {"role": "user", "content": "a cat sat on the mat"},
        {"role": "assistant", "content": "the dog ran far away"},
        {"role": "user", "content": "big red house"},
        {"role": "assistant", "content": "small blue tree by the river"},
    ],
    [{"role": "user", "content": "night"}, {"role": "assistant", "content": "day"}],
    [{"role": "user", "content": "the bird\nsang"}, {"role": "assistant", "content": "loud"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_model(tmp_path_factory.mktemp("shapes") / "model", "llama-mha")
    make_chat_tokenizer(d)
    return d


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def batches(data, model_dir, fields=None, chat=None):
    w = TokenizeWorker(
        str(data),
        str(model_dir / "tokenizer.json"),
        0,
        1,
        seq_len=32,
        micro_batch_size=2,
        eos_id=2,
        pad_id=0,
        chat_template=chat or load_chat_template(model_dir),
        fields=fields,
    )
    out = []
    while (b := w.next_batch()) is not None:
        out.append(b)
    return out


def assert_same(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "labels", "positions", "segments"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_every_shape_gives_the_batches_of_the_native_form(model_dir, tmp_path):
    native = batches(write_jsonl(tmp_path / "n.jsonl", [{"messages": m} for m in CONVERSATIONS]),
                     model_dir)  # fmt: skip
    # ShareGPT written with OpenAI's role names
    sharegpt = [{"conversations": [{"from": m["role"], "value": m["content"]} for m in c]}
                for c in CONVERSATIONS]  # fmt: skip
    assert_same(batches(write_jsonl(tmp_path / "s.jsonl", sharegpt), model_dir), native)
    # OpenAI content parts: the texts joined
    parts = [
        {"messages": [{"role": m["role"], "content": [{"type": "text", "text": w + " "}
                       for w in m["content"].split(" ")[:-1]]
                      + [{"type": "text", "text": m["content"].split(" ")[-1]}]} for m in c]}
        for c in CONVERSATIONS
    ]  # fmt: skip
    assert_same(batches(write_jsonl(tmp_path / "p.jsonl", parts), model_dir), native)
    # another shape, mapped: axolotl's field_messages / message_property_mappings / roles
    names = {"system": "sys", "user": "usr", "assistant": "bot"}
    mapped = [{"id": i, "dialog": [{"speaker": names[m["role"]], "says": m["content"]} for m in c]}
              for i, c in enumerate(CONVERSATIONS)]  # fmt: skip
    cfg = build_config(
        {
            "model": "m", "data": "d", "output": "o", "field_messages": "dialog",
            "message_property_mappings": {"role": "speaker", "content": "says"},
            "roles": {"system": ["sys"], "user": ["usr", "person"], "assistant": "bot"},
        }
    )  # fmt: skip
    fields = cfg.field_map()
    assert fields == FieldMap(
        "dialog", "speaker", "says", (("sys", "system"), ("usr", "user"), ("person", "user"),
                                      ("bot", "assistant"))
    )  # fmt: skip
    data = write_jsonl(tmp_path / "m.jsonl", mapped)
    assert_same(batches(data, model_dir, fields), native)
    # the same by flags
    flags = build_config(
        flag_values={
            "model": "m",
            "data": "d",
            "output": "o",
            "field_messages": "dialog",
            "message_property_mappings": "role=speaker,content=says",
            "roles": "system=sys,user=usr,user=person,assistant=bot",
        }
    )
    assert flags.field_map() == fields  # fmt: skip


def test_alpaca_csv_and_tsv_records_give_the_batches_of_their_conversations(model_dir, tmp_path):
    alpaca = [
        {"instruction": "a cat sat", "input": "on the mat", "output": "the dog ran"},
        {"instruction": "night", "input": "", "output": "day"},
        {"instruction": "big house", "output": "small tree", "system": "the sun"},
    ]
    conversations = [
        [{"role": "user", "content": "a cat sat\non the mat"},
         {"role": "assistant", "content": "the dog ran"}],
        [{"role": "user", "content": "night"}, {"role": "assistant", "content": "day"}],
        [{"role": "system", "content": "the sun"}, {"role": "user", "content": "big house"},
         {"role": "assistant", "content": "small tree"}],
    ]  # fmt: skip
    native = batches(write_jsonl(tmp_path / "n.jsonl", [{"messages": c} for c in conversations]),
                     model_dir)  # fmt: skip
    assert_same(batches(write_jsonl(tmp_path / "a.jsonl", alpaca), model_dir), native)
    # a spreadsheet's export: a header, quoted cells holding the separator and line breaks
    (tmp_path / "a.csv").write_text(
        "instruction,input,output,system\n"
        'a cat sat,"on the mat",the dog ran,\n'
        "night,,day,\n"
        '"big house",,"small tree",the sun\n'
    )
    assert_same(batches(tmp_path / "a.csv", model_dir), native)
    (tmp_path / "t").mkdir()  # a compressed TSV
    tsv = "instruction\tinput\toutput\nnight\t\tday\n"
    (tmp_path / "t" / "a.tsv.gz").write_bytes(gzip.compress(tsv.encode()))
    one = batches(write_jsonl(tmp_path / "one.jsonl", alpaca[1:2]), model_dir)
    assert_same(batches(tmp_path / "t", model_dir), one)
    # prompt + completion and text columns, as in JSON Lines
    (tmp_path / "pc.csv").write_text('prompt,completion\n"a dog, big",ran far\n')
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a dog, big", "completion": "ran far"}])
    assert_same(batches(tmp_path / "pc.csv", model_dir), batches(pc, model_dir))


def test_a_mapped_dataset_evaluates_to_the_loss_of_its_native_form(model_dir, tmp_path):
    native = write_jsonl(tmp_path / "n.jsonl", [{"messages": m} for m in CONVERSATIONS])
    mapped = write_jsonl(
        tmp_path / "m.jsonl",
        [{"turns": [{"r": m["role"], "t": m["content"]} for m in c]} for c in CONVERSATIONS],
    )
    fields = FieldMap("turns", "r", "t")
    ours = evaluate(model_dir, mapped, seq_len=64, fields=fields)
    assert ours == evaluate(model_dir, native, seq_len=64)
    assert ours["tokens"] > 0


@pytest.mark.parametrize(
    "line, fields, message",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                    {"role": "assistant", "content": "a"},
                ]
            },
            None,
            '"messages"[0].content[0] is a "image_url" part: only text parts ({"type": "text", '
            '"text": "..."}) can be trained on a text model; drop the part (or the record)',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            None,
            '"messages"[0].content[0].text must be a string (found a number)',
        ),
        (
            {"dialog": [{"speaker": "usr", "says": "a"}]},
            None,
            'record has no "text" (nor "prompt" + "completion", "messages", "conversations"); '
            'keys found: "dialog" (a conversation under "dialog"? --field-messages dialog)',
        ),
        (
            {"dialog": [{"speaker": "usr", "says": "a"}]},
            FieldMap("dialog"),
            '"dialog"[0] must be {"role", "content"} (its keys: "speaker", "says"; for other '
            "names: --message-property-mappings role=KEY,content=KEY)",
        ),
        (
            {"dialog": [{"speaker": "usr", "says": "a"}]},
            FieldMap("dialog", "speaker", "says"),
            "\"dialog\"[0] has unknown speaker 'usr'; expected one of system, human, user, gpt, "
            "assistant, tool (or name it: --roles user=NAME, assistant=NAME, ...)",
        ),
        (
            {"instruction": ["a"], "output": "b"},
            None,
            '"instruction" must be a string, found an array',
        ),
    ],
)
def test_bad_records_of_every_shape_name_file_line_and_fix(model_dir, tmp_path, line, fields,
                                                           message):  # fmt: skip
    data = write_jsonl(tmp_path / "bad.jsonl", [{"text": "the cat"}, line])
    with pytest.raises(DataError) as e:
        batches(data, model_dir, fields)
    assert str(e.value) == (
        f"{data}:2: {message} (fix the record, or pass --on-bad-record skip to skip bad records)"
    )


def test_bad_csv_files_name_file_and_line(model_dir, tmp_path):
    (tmp_path / "a.csv").write_text('text\nthe cat\n"the dog",sat\n')
    with pytest.raises(DataError) as e:
        batches(tmp_path / "a.csv", model_dir)
    assert str(e.value) == (
        f"{tmp_path / 'a.csv'}:3: the row has 2 cells, the header 1: quote a cell that holds the "
        "separator (',')"
    )
    (tmp_path / "b.tsv").write_bytes(b"text\nthe \xff cat\n")
    with pytest.raises(DataError, match=r"b.tsv: not valid UTF-8 \(invalid start byte, after "):
        batches(tmp_path / "b.tsv", model_dir)
    (tmp_path / "c.csv").write_text("txt\nthe cat\n")
    with pytest.raises(DataError, match=r'c.csv:2: record has no "text" .*keys found: "txt"'):
        batches(tmp_path / "c.csv", model_dir)


def test_mapping_flags_and_keys_are_checked_naming_them():
    with pytest.raises(ConfigError) as e:
        build_config(
            {"model": "m", "data": "d", "output": "o", "roles": {"robot": "r"}},
            {"message_property_mappings": "speaker=from"},
            source="--config c.yaml",
        )
    assert str(e.value).splitlines() == [
        "--message-property-mappings: speaker=from is not role=KEY or content=KEY (e.g. "
        "role=from,content=value)",
        "--config c.yaml: roles: robot=r is not ROLE=NAME with ROLE one of system, user, "
        "assistant, tool (e.g. user=human,assistant=bot)",
    ]
    with pytest.raises(ConfigError, match="--roles: x is given to both user and assistant"):
        build_config(flag_values={"roles": "user=x,assistant=x"})


# what each template renders for CONVERSATIONS[1], as its model's tokenizer_config.json gives it
PUBLISHED = {
    "chatml": "<|im_start|>user\nnight<|im_end|>\n<|im_start|>assistant\nday<|im_end|>\n",
    "llama3": "<s><|start_header_id|>user<|end_header_id|>\n\nnight<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nday<|eot_id|>",
    "gemma": "<s><start_of_turn>user\nnight<end_of_turn>\n<start_of_turn>model\nday<end_of_turn>\n",
    "mistral": "<s>[INST] night [/INST]day</s>",
}


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_named_templates_render_as_their_models_publish_them_and_as_transformers_does(
    model_dir, name
):
    chat = load_chat_template(model_dir, name)
    assert chat.source == f"--chat-template {name}"
    messages = CONVERSATIONS[1]
    assert chat.render(messages, False) == PUBLISHED[name]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for k in (1, 2):  # a generation prompt too: the assistant turn's span starts after it
        for gen in (True, False):
            assert chat.render(messages[:k], gen) == tok.apply_chat_template(
                messages[:k], chat_template=NAMED_TEMPLATES[name], tokenize=False,
                add_generation_prompt=gen,
            )  # fmt: skip
    # a base model without a template trains chat data with one by name
    assert batches(write_jsonl(model_dir.parent / f"{name}.jsonl", [{"messages": messages}]),
                   model_dir, chat=chat)  # fmt: skip


def test_a_template_name_is_not_taken_for_a_file(model_dir, tmp_path):
    assert isinstance(load_chat_template(model_dir, "chatml"), ChatTemplate)
    from appliance.data.chat import ChatError

    with pytest.raises(ChatError) as e:
        load_chat_template(model_dir, "chatml2")
    assert str(e.value) == (
        "--chat-template chatml2: no such file, nor a built-in name (chatml, llama3, gemma, "
        "mistral)"
    )
