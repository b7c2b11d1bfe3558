"""appliance.data.records: sharding, record parsing, tokenizer loading, encoding."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from appliance.data.records import (
    SKIP_HINT,
    DataError,
    Holdout,
    RawDocument,
    Record,
    ShardReader,
    check_has_targets,
    check_tokenizer_fits,
    encode_records,
    find_data_files,
    load_tokenizer,
    parse_document,
)
from tests.helpers_data import write_jsonl
from tests.helpers_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# -- sharding --------------------------------------------------------------------------------


def test_shards_are_disjoint_cover_the_dataset_and_skip_blank_lines(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(5)], blank_lines=True)
    (tmp_path / "b.txt").write_text("b0")
    write_jsonl(tmp_path / "c.jsonl", [{"text": f"c{i}"} for i in range(4)])
    files = find_data_files(tmp_path)
    order = [f"a{i}" for i in range(5)] + ["b0"] + [f"c{i}" for i in range(4)]

    def text(raw: RawDocument) -> str:
        return parse_document(raw).text

    seen = []
    for w in range(3):
        reader = ShardReader(files, w, 3)
        docs = list(reader)
        assert [d.doc for d in docs] == list(range(len(docs)))  # shard indices are dense
        assert [text(d) for d in docs] == order[w::3]  # global index % N == w
        assert reader.total_documents == 10
        seen += [text(d) for d in docs]
    assert sorted(seen) == sorted(order)

    # .jsonl documents are located by file:line (blank lines count as lines, not documents).
    first = list(ShardReader(files, 1, 3))
    assert first[0].where == f"{tmp_path / 'a.jsonl'}:3"
    assert first[1].where == f"{tmp_path / 'a.jsonl'}:9"
    assert first[2].where == f"{tmp_path / 'c.jsonl'}:2" and first[2].kind == "jsonl"
    assert list(ShardReader(files, 2, 3))[1].where == str(tmp_path / "b.txt")


def test_shard_reader_starts_at_a_shard_index(tmp_path):
    files = [write_jsonl(tmp_path / "a.jsonl", [{"text": str(i)} for i in range(20)])]
    full = list(ShardReader(files, 1, 4))
    assert list(ShardReader(files, 1, 4, start_doc=2)) == full[2:]


# -- parsing ---------------------------------------------------------------------------------


def raw(data: bytes, kind: str = "jsonl", where: str = "d.jsonl:7") -> RawDocument:
    return RawDocument(0, where, data, kind)


def test_parse_text_and_prompt_completion():
    assert parse_document(raw(b'{"text": "hi", "id": 3}\n')) == Record(text="hi")
    pc = parse_document(raw(b'{"prompt": "q", "completion": "a"}'))
    assert pc == Record(prompt="q", completion="a")
    assert parse_document(raw("caf\u00e9\n".encode(), "txt", "x.txt")) == Record(text="café\n")
    assert parse_document(raw(b'\xef\xbb\xbf{"text": "bom"}')).text == "bom"  # BOM tolerated


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"text": "a"', "d.jsonl:7: malformed JSON: Expecting ',' delimiter at column 13"),
        # a line cut short is reported where it ends, not at its line break
        (b'{"text": "a"\n', "d.jsonl:7: malformed JSON: Expecting ',' delimiter at column 13"),
        (b"[1, 2]", "d.jsonl:7: expected a JSON object, found an array"),
        (
            b'{"txt": "a", "meta": 1}',
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); '
            'keys found: "meta", "txt"',
        ),
        (
            b'{"prompt": "a"}',
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: "prompt"',
        ),
        (
            b'{"instruction": "a", "input": "", "output": 3}',
            'd.jsonl:7: "output" must be a string, found a number',
        ),
        (
            b"{}",
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: none',
        ),
        (b'{"text": 5}', 'd.jsonl:7: "text" must be a string, found a number'),
        (
            b'{"prompt": "a", "completion": null}',
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", '
            '"conversations"); keys found: "prompt"; null: "completion"',
        ),
        (
            b'{"text": null, "id": 3}',
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", '
            '"conversations"); keys found: "id"; null: "text"',
        ),
        (
            b'{"text": "\xff"}',
            "d.jsonl:7: not valid UTF-8 (invalid start byte at byte 10)",
        ),
    ],
)
def test_bad_records_name_file_line_and_problem(data, message):
    with pytest.raises(DataError) as e:
        parse_document(raw(data))
    assert str(e.value) == message


def test_a_table_column_json_cannot_hold_is_ignored_unless_it_holds_the_text(tmp_path):
    """A parquet row arrives as its values, not as JSON: a date, bytes or decimal column beside
    the text (a crawl's `timestamp`, an image's bytes) is left alone, and one in the text's place
    is named with its type."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    day, raw_bytes = datetime.datetime(2024, 1, 2, 3, 4), b"\x89PNG"
    f = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {
                "text": ["the cat", "the dog"],
                "created": [day, day],
                "image": [raw_bytes, None],
                "price": [decimal.Decimal("1.50"), decimal.Decimal("2")],
            }
        ),
        f,
    )
    docs = list(ShardReader([f], 0, 1))
    assert [parse_document(d) for d in docs] == [Record(text="the cat"), Record(text="the dog")]
    assert docs[0].where == f"{f}:row 0"

    g = tmp_path / "u.parquet"
    pq.write_table(pa.table({"text": [day], "prompt": [raw_bytes], "completion": ["a"]}), g)
    (doc,) = ShardReader([g], 0, 1)
    with pytest.raises(DataError, match=rf'^{g}:row 0: "text" must be a string, found a datetime'):
        parse_document(doc)
    h = tmp_path / "v.parquet"
    pq.write_table(pa.table({"prompt": [raw_bytes], "completion": ["a"]}), h)
    with pytest.raises(DataError, match=r'"prompt" must be a string, found bytes \(a binary'):
        parse_document(next(iter(ShardReader([h], 0, 1))))


def test_malformed_json_says_at_once_and_how_to_write_a_control_character():
    with pytest.raises(DataError) as e:
        parse_document(raw(b'{"id": 1, "text": "a\tb"}'))  # a raw tab inside a string
    assert str(e.value) == (
        "d.jsonl:7: malformed JSON: Invalid control character at column 21 (a tab or other "
        "control character inside a string must be escaped: \\t)"
    )


def test_a_bad_record_that_fails_the_run_says_how_to_skip_it(tmp_path, tok):
    path, _, eos, _ = tok
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, "{oops"])
    with pytest.raises(DataError) as e:
        check_has_targets(data, load_tokenizer(path), eos)
    assert str(e.value) == (
        f"{data}:2: malformed JSON: Expecting property name enclosed in double quotes at "
        f"column 2 ({SKIP_HINT})"
    )
    assert SKIP_HINT == "fix the record, or pass --on-bad-record skip to skip bad records"
    # skipped: the good record teaches
    check_has_targets(data, load_tokenizer(path), eos, on_bad_record="skip")


def test_a_dataset_with_nothing_to_learn_says_why(tmp_path, tok):
    """Every record bad (and skipped), or every one held out: said so, not "no target token"."""
    path, _, eos, _ = tok
    t = load_tokenizer(path)
    data = write_jsonl(tmp_path / "d.jsonl", [{"txt": "the cat"}, {"txt": "the dog"}])
    with pytest.raises(DataError) as e:
        check_has_targets(data, t, eos, on_bad_record="skip")
    assert str(e.value) == (
        f"{data}: every record (2) is bad, and --on-bad-record skip skipped them all, so there "
        f'is nothing to learn; the first: {data}:1: record has no "text" (nor "prompt" + '
        '"completion", "messages", "conversations"); keys found: "txt"'
    )
    data = write_jsonl(tmp_path / "e.jsonl", [{"text": "the cat"}])
    with pytest.raises(DataError, match=r"--eval-split 0.999 holds out every document"):
        check_has_targets(data, t, eos, holdout=Holdout(0.999, seed=0))
    data = write_jsonl(tmp_path / "f.jsonl", [{"text": ""}, {"text": " "}])
    with pytest.raises(DataError, match=r"f\.jsonl: no record has a target token"):
        check_has_targets(data, t, eos)


def test_non_utf8_txt_names_the_file():
    with pytest.raises(DataError) as e:
        parse_document(raw(b"ok \xc3\x28", "txt", "/data/x.txt"))
    assert str(e.value) == "/data/x.txt: not valid UTF-8 (invalid continuation byte at byte 3)"


def test_data_error_pickles_with_its_message():
    e = pickle.loads(pickle.dumps(DataError("d.jsonl:3: malformed JSON")))
    assert isinstance(e, DataError) and str(e) == "d.jsonl:3: malformed JSON"


# -- tokenizer -------------------------------------------------------------------------------


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(DataError) as e:
        load_tokenizer(tmp_path)  # a model directory without tokenizer.json
    assert str(e.value) == (
        f"tokenizer not found: {tmp_path / 'tokenizer.json'} (expected a tokenizer.json file)"
    )
    with pytest.raises(DataError, match=r"^tokenizer not found: .*/x/tokenizer\.json"):
        load_tokenizer(tmp_path / "x" / "tokenizer.json")


def test_corrupt_tokenizer_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"^cannot load tokenizer .*tokenizer\.json: "):
        load_tokenizer(tmp_path)


def test_load_tokenizer_accepts_a_directory_and_disables_truncation(tmp_path, tok):
    path, bos, eos, _ = tok
    t = load_tokenizer(path)
    t.enable_truncation(3)
    t.save(str(tmp_path / "tokenizer.json"))
    t2 = load_tokenizer(tmp_path)  # the model directory form
    assert t2.truncation is None and t2.padding is None
    assert len(t2.encode("the cat sat on the mat").ids) == 7  # BOS + 6 words, not truncated


def test_encode_records_appends_eos_and_masks_prompts(tok):
    path, bos, eos, _ = tok
    t = load_tokenizer(path)
    records = [
        Record(text="the cat sat"),
        Record(prompt="the dog", completion="ran far away"),
        Record(text=""),
        Record(text=" \n "),
    ]
    (ids0, m0), (ids1, m1), (ids2, m2), (ids3, m3) = encode_records(t, records, eos)
    assert ids0.tolist() == t.encode("the cat sat").ids + [eos] and ids0[0] == bos
    assert m0.all() and ids0.dtype == np.int64
    p = t.encode("the dog").ids
    c = t.encode("ran far away", add_special_tokens=False).ids
    assert ids1.tolist() == p + c + [eos]
    assert m1.tolist() == [False] * len(p) + [True] * (len(c) + 1)
    # an empty or blank text is no document (not BOS + EOS: that would teach the model to stop)
    assert ids2.tolist() == ids3.tolist() == m2.tolist() == m3.tolist() == []
    assert ids2.dtype == np.int64 and m3.dtype == bool
    assert encode_records(t, [], eos) == []


def test_a_tokenizer_with_ids_past_the_model_vocabulary_is_refused(tmp_path, tok):
    path = tok[0]
    largest = max(load_tokenizer(path).get_vocab(with_added_tokens=True).values())
    model = tmp_path / "model"  # its config.json says vocab_size `largest`: one id short
    with pytest.raises(DataError) as e:
        check_tokenizer_fits(path, largest, model)
    message = str(e.value)
    assert message.startswith(f"{path} gives token ids up to {largest} (")
    assert f"{model / 'config.json'} has vocab_size {largest}" in message
    assert "use the tokenizer.json that came with the model" in message
    check_tokenizer_fits(path, largest + 1, model)  # every id has an embedding
    check_tokenizer_fits(path, 4 * largest, model)  # a padded vocabulary is fine
