"""Conversations: rendered with the model's chat template as transformers renders it, trained
on the assistant turns exactly as chat.py defines; ShareGPT, parquet, .json arrays and compressed
files read like JSONL; every bad input named with its file:line (or file:row)."""

from __future__ import annotations

import gzip
import json
import lzma

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import transformers

from appliance.actors.tokenize_worker import TokenizeWorker
from appliance.adapter.evaluate import evaluate
from appliance.data.chat import ChatError, load_chat_template, messages_of, target_mask
from appliance.data.listing import find_data_files, unreadable_files
from appliance.data.records import (
    SKIP_HINT,
    ShardReader,
    encode_records,
    load_tokenizer,
    parse_document,
)
from appliance.errors import DataError
from tests.helpers_model import load_hf, make_model
from tests.helpers_tokenizer import (
    CHAT_TEMPLATE,
    SPACE_PROMPT_TEMPLATE,
    make_chat_tokenizer,
    make_subword_chat_tokenizer,
)

RTOL = 1e-5

CONVERSATIONS = [
    [
        {"role": "system", "content": "the sun"},
        {"role": "user", "content": "a cat sat on the mat"},
        {"role": "assistant", "content": "the dog ran far away"},
        {"role": "user", "content": "big red house"},
        {"role": "assistant", "content": "small blue tree by the river"},
    ],
    [
        {"role": "user", "content": "night"},
        {"role": "assistant", "content": "day"},
    ],
    [
        {"role": "user", "content": "the bird sang"},
        {"role": "assistant", "content": "loud"},
        {"role": "tool", "content": "rain snow"},
        {"role": "assistant", "content": "the wind is fast and the moon is slow " * 3},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_model(tmp_path_factory.mktemp("chat") / "model", "llama-mha")
    make_chat_tokenizer(d)
    return d


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path, records):
    """Records as a parquet table: one column per key, null where a record lacks it."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    pq.write_table(pa.table({k: [r.get(k) for r in records] for k in keys}), path)


def write_arrow(path, records, stream: bool):
    """Records as an Arrow IPC file: the stream format (what `datasets` writes) or the file
    format, two record batches, null where a record lacks a key."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    table = pa.table({k: [r.get(k) for r in records] for k in keys})
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with new(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=max(1, len(records) // 2)):
            writer.write_batch(batch)


def reference_loss(model_dir, conversations, seq_len) -> tuple[float, int]:
    """The targets of chat.py's definition, computed independently: transformers renders the
    template (apply_chat_template) and gives the offsets; the loss is the HF model's."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = load_hf(model_dir)
    total, n = 0.0, 0
    for messages in conversations:
        full = tok.apply_chat_template(messages, tokenize=False)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                start = tok.apply_chat_template(
                    messages[:k], tokenize=False, add_generation_prompt=True
                )
                end = tok.apply_chat_template(messages[: k + 1], tokenize=False)
                spans.append((len(start), len(end)))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"][:seq_len]
        target = [any(s < b and a < e for a, b in spans) for s, e in enc["offset_mapping"]]
        target = target[:seq_len]
        labels = torch.tensor(
            [t if ok else -100 for t, ok in zip(ids[1:], target[1:], strict=True)]
        )
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits.float()[0, :-1]
        total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
        n += int((labels != -100).sum())
    return total / n, n


@pytest.mark.parametrize("seq_len", [200, 40])  # whole conversations; truncated ones
def test_eval_loss_on_conversations_equals_transformers_on_the_defined_targets(
    model_dir, tmp_path, seq_len
):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    ours = evaluate(model_dir, data, seq_len=seq_len)
    loss, n = reference_loss(model_dir, CONVERSATIONS, seq_len)
    assert ours["tokens"] == n
    assert abs(ours["loss"] - loss) / loss < RTOL


def worker_batches(data, model_dir, **kw):
    w = TokenizeWorker(
        str(data),
        str(model_dir / "tokenizer.json"),
        0,
        1,
        seq_len=32,
        micro_batch_size=2,
        eos_id=2,
        pad_id=0,
        chat_template=load_chat_template(model_dir),
        **kw,
    )
    out = []
    while (b := w.next_batch()) is not None:
        out.append(b)
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "labels", "positions", "segments"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_only_assistant_turns_and_their_end_of_turn_are_targets(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1]}])
    [b] = worker_batches(data, model_dir)
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    added = {
        t["content"]: t["id"]
        for t in json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    targets = b.labels[b.labels != -100].tolist()
    assert targets == [vocab["day"], added["<|im_end|>"]]  # not "user", "night", nor the prompt


def test_sharegpt_parquet_json_and_compressed_files_give_the_same_batches_as_jsonl(
    model_dir, tmp_path
):
    records = [{"messages": m} for m in CONVERSATIONS] + [
        {"text": "the cat sat"},
        {"prompt": "a dog", "completion": "ran far"},
    ]
    jsonl = worker_batches(write_jsonl(tmp_path / "a.jsonl", records), model_dir)
    names = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
    sharegpt = [
        {
            "conversations": [
                {"from": names[m["role"]], "value": m["content"]} for m in r["messages"]
            ]
        }
        if "messages" in r
        else r
        for r in records
    ]
    assert_same(worker_batches(write_jsonl(tmp_path / "s.jsonl", sharegpt), model_dir), jsonl)
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "0.parquet", records[:2])
    write_parquet(tmp_path / "pq" / "1.parquet", records[2:])
    assert_same(worker_batches(tmp_path / "pq", model_dir), jsonl)
    # .arrow as datasets' save_to_disk writes it (the IPC stream format), and the IPC file format
    (tmp_path / "arrow").mkdir()
    write_arrow(tmp_path / "arrow" / "data-00000-of-00002.arrow", records[:3], stream=True)
    write_arrow(tmp_path / "arrow" / "data-00001-of-00002.arrow", records[3:], stream=False)
    (tmp_path / "arrow" / "state.json").write_text('{"_split": "train"}')  # metadata beside them
    (tmp_path / "arrow" / "dataset_info.json").write_text("{}")
    assert_same(worker_batches(tmp_path / "arrow", model_dir), jsonl)
    # a .json array (as alpaca-style files are), and compressed JSON Lines, read like JSONL
    (tmp_path / "array.json").write_text(json.dumps(sharegpt, indent=1))
    assert_same(worker_batches(tmp_path / "array.json", model_dir), jsonl)
    (tmp_path / "zipped").mkdir()
    lines = (tmp_path / "a.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "zipped" / "0.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:3])))
    (tmp_path / "zipped" / "1.json.xz").write_bytes(lzma.compress(b"".join(lines[3:])))
    assert_same(worker_batches(tmp_path / "zipped", model_dir), jsonl)


def test_template_sources_named_list_jinja_file_and_override(model_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    make_chat_tokenizer(d, template=None)
    assert load_chat_template(d) is None
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": CHAT_TEMPLATE},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(d).template == CHAT_TEMPLATE
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(d).source.endswith("chat_template.jinja")
    (tmp_path / "mine.jinja").write_text(CHAT_TEMPLATE)
    assert load_chat_template(d, tmp_path / "mine.jinja").template == CHAT_TEMPLATE
    with pytest.raises(ChatError, match="--chat-template nope.jinja: no such file"):
        load_chat_template(d, "nope.jinja")


def test_a_template_that_does_not_compile_names_its_source_and_line(tmp_path):
    bad = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"  # line 2 lacks a brace
    (tmp_path / "bad.jinja").write_text(bad)
    with pytest.raises(ChatError) as e:
        load_chat_template(tmp_path, tmp_path / "bad.jinja")
    assert str(e.value) == (
        f"chat template {tmp_path / 'bad.jinja'} does not compile, at its line 2: unexpected '}}'"
    )
    d = tmp_path / "m"  # the model's own: tokenizer_config.json's chat_template
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "hi\n" + bad}))
    with pytest.raises(ChatError) as e:
        load_chat_template(d)
    assert str(e.value) == (
        f"chat template {d / 'tokenizer_config.json'} chat_template does not compile, at its "
        "line 3: unexpected '}'"
    )


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"messages": "hi"},
            '"messages" must be a list of {"role": ..., "content": "..."} objects (found a string)',
        ),
        (
            {"messages": []},
            '"messages" is empty: a conversation needs at least one assistant turn',
        ),
        ({"messages": [{"role": "user"}]}, '"messages"[0] must be {"role", "content"}'),
        (
            {"messages": [{"role": "user", "content": 3}]},
            '"messages"[0].content must be a string or a list of text parts (found a number)',
        ),
        (
            {"messages": [{"role": "user", "content": None}]},
            '"messages"[0].content must be a string or a list of text parts (found null)',
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "tool_calls": []},
                ]
            },
            '"messages"[1] must be {"role", "content"}',
        ),
        (
            {"messages": CONVERSATIONS[1], "tools": {"name": "weather"}},
            '"tools" must be a list of objects (found an object)',
        ),
        (
            {"messages": CONVERSATIONS[1], "tools": ["weather"]},
            '"tools"[0] must be an object (found a string)',
        ),
        (
            {"messages": CONVERSATIONS[1], "tools": "[{oops"},
            '"tools" is a string that is not JSON (Expecting property name enclosed in double '
            "quotes: line 1 column 3 (char 2))",
        ),
        (
            {"messages": [CONVERSATIONS[1][0], {**CONVERSATIONS[1][1], "weight": 0.5}]},
            '"messages"[1].weight must be 0 or 1 (found 0.5)',
        ),
        (
            {"messages": [CONVERSATIONS[1][0], {**CONVERSATIONS[1][1], "weight": True}]},
            '"messages"[1].weight must be 0 or 1 (found true)',
        ),
        (
            {"messages": [{**CONVERSATIONS[1][0], "weight": 1}, CONVERSATIONS[1][1]]},
            '"messages"[0].weight is 1 on a user message: only assistant turns are trained',
        ),
        (
            {"messages": [CONVERSATIONS[1][0], {**CONVERSATIONS[1][1], "weight": 0}]},
            "every assistant turn has weight 0: nothing to learn",
        ),
        (
            {"messages": [{"role": "robot", "content": "a"}]},
            "\"messages\"[0] has unknown role 'robot'; expected one of system, user, assistant, "
            "tool (or name it: --roles user=NAME, assistant=NAME, ...)",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}]},
            "conversation has no assistant turn: nothing to learn",
        ),
        (
            {"conversations": [{"from": "bot", "value": "a"}]},
            "\"conversations\"[0] has unknown from 'bot'; expected one of system, human, user, "
            "gpt, assistant, tool (or name it: --roles user=NAME, assistant=NAME, ...)",
        ),
    ],
)
def test_bad_chat_records_name_file_and_line(model_dir, tmp_path, record, message):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[1]}, record])
    with pytest.raises(DataError) as e:
        worker_batches(data, model_dir)
    assert (
        str(e.value)
        == f"{data}:2: {message} (fix the record, or pass --on-bad-record skip to skip bad records)"
    )
    skipped = worker_batches(data, model_dir, on_bad_record="skip")  # or skipped and counted
    assert skipped[-1].skipped_records == 1


def test_chat_record_without_a_template_says_to_pass_one(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}])
    w = TokenizeWorker(str(data), str(model_dir / "tokenizer.json"), 0, 1, 16, 1, 2, 0)
    with pytest.raises(
        DataError,
        match=r"c.jsonl:1: a chat record, but the tokenizer has no "
        r"chat template .*pass --chat-template NAME \(chatml, llama3, gemma, mistral\) or FILE",
    ):
        w.next_batch()


def test_template_whose_prefixes_move_is_refused_naming_it(model_dir, tmp_path):
    # puts the number of messages first: a prefix renders differently from the whole
    (tmp_path / "t.jinja").write_text(
        "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match=r"c.jsonl:1: chat template .*t.jinja renders the first"):
        evaluate(model_dir, data, seq_len=32, chat_template=tmp_path / "t.jinja")


def test_parquet_errors_name_file_and_row_and_other_files_are_named(model_dir, tmp_path):
    (tmp_path / "d").mkdir()
    write_parquet(tmp_path / "d" / "p.parquet", [{"text": "the cat"}, {"body": "x"}])
    (tmp_path / "e").mkdir()
    write_arrow(tmp_path / "e" / "a.arrow", [{"text": "a"}] * 3 + [{"body": "x"}], stream=True)
    with pytest.raises(DataError, match=r"a.arrow:row 3: record has no \"text\""):
        worker_batches(tmp_path / "e", model_dir)
    (tmp_path / "e" / "b.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=r"b.arrow: cannot read as arrow: "):
        find_data_files(tmp_path / "e" / "b.arrow")
    (tmp_path / "d" / "notes.xlsx").write_text("a,b\n")
    assert unreadable_files(tmp_path / "d") == ["notes.xlsx"]
    assert find_data_files(tmp_path / "d") == [tmp_path / "d" / "p.parquet"]
    with pytest.raises(
        DataError,
        match=r"p.parquet:row 1: record has no \"text\".*keys found: \"body\"; null: \"text\" \(",
    ):
        worker_batches(tmp_path / "d", model_dir)


def test_a_token_is_a_target_when_it_shares_a_character_with_a_span():
    spans = [(5, 10), (20, 30)]
    offsets = [(0, 4), (4, 6), (6, 10), (10, 12), (9, 11), (5, 5), (7, 7), (10, 10), (19, 21)]
    # (4, 6): the prompt's last character and the answer's first; (5, 5) and (10, 10): no
    # character, at a span's edge; (7, 7): no character, inside one
    expected = [False, True, True, False, True, False, True, False, True]
    assert target_mask(offsets, spans) == expected


def with_generation(template: str, turn: str) -> str:
    """`template` with the assistant `turn` in transformers' {% generation %} tags: the reference
    template that `apply_chat_template(..., return_assistant_tokens_mask=True)` masks."""
    assert template.count(turn) == 1
    return template.replace(turn, "{% generation %}" + turn + "{% endgeneration %}")


def ours_and_transformers(model_dir, record, reference_template, our_template=None):
    """(ids, targets) of `record` as the appliance encodes it (its template: the model's, or the
    file `our_template`), and as transformers' apply_chat_template gives them with its assistant
    mask (`reference_template`: the same one, its trained turns in {% generation %} tags)."""
    raw = ShardReader([write_jsonl(model_dir / "r.jsonl", [record])], 0, 1)
    [parsed] = [parse_document(r, load_chat_template(model_dir, our_template)) for r in raw]
    [(ids, mask)] = encode_records(load_tokenizer(model_dir), [parsed], eos_id=2)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    out = tok.apply_chat_template(
        record["messages"],
        tools=record.get("tools"),
        chat_template=reference_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return (ids.tolist(), mask.tolist()), (
        out["input_ids"],
        [m == 1 for m in out["assistant_masks"]],
    )


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_targets_are_transformers_assistant_mask_when_the_prompt_space_starts_the_answer(
    tmp_path, kind
):
    # "### Assistant: the dog": the answer's first token is "Ġthe" (or "▁the"), its space the
    # generation prompt's: it is trained, as transformers' assistant mask has it
    make_subword_chat_tokenizer(tmp_path, kind)
    reference = with_generation(SPACE_PROMPT_TEMPLATE, "{{ m['content'] }}</s>\n")
    for messages in CONVERSATIONS:
        ours, theirs = ours_and_transformers(tmp_path, {"messages": messages}, reference)
        assert ours == theirs
        assert sum(ours[1]) > len([m for m in messages if m["role"] == "assistant"]) * 2


def test_an_assistant_turn_of_weight_0_is_rendered_but_not_trained(tmp_path):
    make_subword_chat_tokenizer(tmp_path, "byte-level")
    turn = "{{ m['content'] }}</s>\n"
    reference = SPACE_PROMPT_TEMPLATE.replace(
        turn,
        "{% if m.weight == 0 %}"
        + turn
        + "{% else %}{% generation %}"
        + turn
        + "{% endgeneration %}{% endif %}",
    )
    messages = [dict(m) for m in CONVERSATIONS[0]]
    messages[2]["weight"] = 0  # OpenAI's fine-tuning format: this turn is not learned
    messages[4]["weight"] = 1
    ours, theirs = ours_and_transformers(tmp_path, {"messages": messages}, reference)
    assert ours == theirs
    unweighted = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    every_turn, _ = ours_and_transformers(tmp_path, {"messages": unweighted}, reference)
    assert every_turn[0] == ours[0] and sum(every_turn[1]) > sum(ours[1])


# A template that reads what OpenAI-style tool use records carry beyond role and content
TOOL_TURN = (
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}"
    "<call>{{ c.function.name }}({{ c.function.arguments }})</call>"
    "{% endfor %}</s>\n"
)
TOOL_TEMPLATE = (
    "{% if tools %}### tools:{% for t in tools %} {{ t.function.name }}{% endfor %}.\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}### Assistant: " + TOOL_TURN + "{% elif m.role == 'tool' %}"
    "### tool {{ m.tool_call_id }} {{ m.name }}: {{ m.content }}\n"
    "{% else %}### {{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant: {% endif %}"
)
TOOL_RECORD = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"day": {"type": "integer"}}},
            },
        }
    ],
    "messages": [
        {"role": "user", "content": "rain"},
        {
            "role": "assistant",
            "content": None,  # OpenAI's form of a turn that only calls tools
            "reasoning_content": "the sun",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"day": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "snow"},
        {"role": "assistant", "content": "snow", "weight": 1},
    ],
}


def test_message_keys_and_record_tools_reach_the_template_as_transformers_passes_them(tmp_path):
    make_subword_chat_tokenizer(tmp_path, "byte-level")
    (tmp_path / "tools.jinja").write_text(TOOL_TEMPLATE)
    reference = with_generation(TOOL_TEMPLATE, TOOL_TURN)
    no_content = json.loads(json.dumps(TOOL_RECORD))
    del no_content["messages"][1]["content"]  # content missing, not null: the same
    for record in (TOOL_RECORD, no_content):
        ours, theirs = ours_and_transformers(tmp_path, record, reference, tmp_path / "tools.jinja")
        assert ours == theirs
    chat = load_chat_template(tmp_path, tmp_path / "tools.jinja")
    [parsed] = [parse_document(r, chat) for r in ShardReader([tmp_path / "r.jsonl"], 0, 1)]
    assert parsed.text.startswith("### tools: weather.\n### user: rain\n### Assistant: <think>")
    assert '<call>weather({"day": 1})</call>' in parsed.text
    assert parsed.tools == TOOL_RECORD["tools"]
    # a parquet table gives every message every key of its column, null where it had none
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "0.parquet", [TOOL_RECORD])
    [row] = [parse_document(r, chat) for r in ShardReader([tmp_path / "pq" / "0.parquet"], 0, 1)]
    assert (row.text, row.spans) == (parsed.text, parsed.spans)
    # tools stored as a JSON string (ShareGPT function-calling sets): decoded, the same text
    as_string = {**TOOL_RECORD, "tools": json.dumps(TOOL_RECORD["tools"])}
    (tmp_path / "s.jsonl").write_text(json.dumps(as_string) + "\n")
    [decoded] = [parse_document(r, chat) for r in ShardReader([tmp_path / "s.jsonl"], 0, 1)]
    assert (decoded.text, decoded.spans, decoded.tools) == (parsed.text, parsed.spans, parsed.tools)
    # a text column beside the messages, null in this row (a table of mixed records, or the
    # JSON lines `datasets`' to_json writes of one): the record is still the conversation
    (tmp_path / "mixed").mkdir()
    write_parquet(tmp_path / "mixed" / "0.parquet", [{"text": "plain"}, TOOL_RECORD])
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": None, **TOOL_RECORD}) + "\n")
    for f in (tmp_path / "mixed" / "0.parquet", tmp_path / "n.jsonl"):
        *_, last = [parse_document(r, chat) for r in ShardReader([f], 0, 1)]
        assert (last.text, last.spans) == (parsed.text, parsed.spans), f


def test_sharegpt_conversations_keep_their_mapping_and_their_other_keys():
    record = {
        "conversations": [
            {"from": "human", "value": "rain"},
            {"from": "gpt", "value": "snow", "name": "bot", "weight": 1},
        ]
    }
    assert messages_of(record, "s.jsonl:1") == [
        {"role": "user", "content": "rain"},
        {"role": "assistant", "content": "snow", "name": "bot", "weight": 1},
    ]


def test_an_error_the_template_raises_names_the_record(model_dir, tmp_path):
    # as Mistral's and Gemma's templates refuse a system turn
    (tmp_path / "t.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}" + CHAT_TEMPLATE
    )
    data = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[0]}]
    )
    with pytest.raises(DataError) as e:
        evaluate(model_dir, data, seq_len=32, chat_template=tmp_path / "t.jinja")
    assert str(e.value) == (
        f"{data}:2: chat template {tmp_path / 't.jinja'} failed: System role not supported "
        f"({SKIP_HINT})"
    )
    # a template that cannot take what the record gives (content null, beside tool_calls)
    record = {"messages": [CONVERSATIONS[1][0], TOOL_RECORD["messages"][1]]}
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(DataError) as e:
        worker_batches(data, model_dir)
    assert str(e.value).startswith(
        f"{data}:1: chat template {model_dir / 'tokenizer_config.json'} chat_template failed: "
        "TypeError: "
    )


def test_chat_template_flag_takes_a_json_file_that_holds_one(model_dir, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = load_chat_template(model_dir, tmp_path / "tokenizer_config.json")
    assert (chat.source, chat.template) == (
        f"{tmp_path / 'tokenizer_config.json'} chat_template",
        CHAT_TEMPLATE,
    )
    named = {"chat_template": [{"name": "default", "template": CHAT_TEMPLATE}]}
    (tmp_path / "chat_template.json").write_text(json.dumps(named))
    assert load_chat_template(model_dir, tmp_path / "chat_template.json").template == CHAT_TEMPLATE
    (tmp_path / "other.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ChatError) as e:
        load_chat_template(model_dir, tmp_path / "other.json")
    assert str(e.value) == (
        f'--chat-template {tmp_path / "other.json"}: a JSON file without "chat_template"; pass a '
        "jinja template file, or a tokenizer_config.json or chat_template.json that holds one"
    )
