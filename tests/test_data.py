"""appliance.data: file discovery, sharding, record parsing, tokenizer loading, encoding."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from appliance.data import (
    SKIP_HINT,
    DataError,
    RawDocument,
    Record,
    ShardReader,
    check_has_targets,
    check_tokenizer_fits,
    dataset_notes,
    encode_records,
    find_data_files,
    has_documents,
    load_tokenizer,
    not_held_out_notes,
    parse_document,
    split_of,
    unreadable_files,
)
from tests.helpers_tokenizer import make_tokenizer


def write_jsonl(path: Path, records: list, blank_lines: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    if blank_lines:
        lines = [x for line in lines for x in (line, "   ")]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# -- discovery -------------------------------------------------------------------------------


def test_find_data_files_is_recursive_sorted_and_ignores_other_files(tmp_path):
    names = [
        *("b.jsonl", "a/z.txt", "a/y.jsonl", "c.md", "a/notes.json", "a/b/x.TXT", "0.txt"),
        *("d.jsonl.gz", "e.csv.gz", "f.parquet.gz", "a/dataset_info.json", "t.txt.zst"),
        *("g.arrow", "h.arrow.gz", "a/state.json"),
    ]
    for rel in names:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    files = find_data_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "0.txt",
        "a/b/x.TXT",
        "a/notes.json",
        "a/y.jsonl",
        "a/z.txt",
        "b.jsonl",
        "d.jsonl.gz",
        "g.arrow",
        "t.txt.zst",
    ]
    # datasets' metadata beside the data is not data; nor is a compressed .csv or .parquet
    assert unreadable_files(tmp_path) == [
        "a/dataset_info.json",
        "a/state.json",
        "c.md",
        "e.csv.gz",
        "f.parquet.gz",
        "h.arrow.gz",
    ]


def test_find_data_files_single_file(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    assert find_data_files(f) == [f]


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match=r"^dataset not found: .*/nope$"):
        find_data_files(tmp_path / "nope")


def test_directory_without_data_files_is_named(tmp_path):
    (tmp_path / "readme.md").write_text("hi")
    with pytest.raises(DataError) as e:
        find_data_files(tmp_path)
    assert str(e.value) == (
        "empty dataset: no data files (.jsonl, .json, .parquet, .arrow or .txt; .jsonl, .json "
        f"and .txt also .gz, .bz2, .xz or .zst) under {tmp_path} (skipped 1 other file(s): "
        "readme.md)"
    )


def test_unsupported_single_file(tmp_path):
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(
        DataError,
        match=r"unsupported dataset file .*d\.csv: expected a data file \(\.jsonl, \.json,",
    ):
        find_data_files(tmp_path / "d.csv")


def test_has_documents(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    assert not has_documents([empty])
    assert has_documents([empty, write_jsonl(tmp_path / "f.jsonl", [{"text": "a"}])])
    (tmp_path / "t.txt").write_text("")
    assert has_documents([tmp_path / "t.txt"])  # a .txt file is a document even if empty


def test_split_names_as_datasets_reads_them():
    assert split_of("data/train-00000-of-00002.parquet") == "train"
    assert split_of("data/validation-00000-of-00001.parquet") == "validation"
    assert split_of("test.jsonl") == "test"
    assert split_of("dev/part-0.jsonl.gz") == "validation"  # a directory names it too
    assert split_of("my_eval_set.json") == "test"
    assert split_of("contest.jsonl") is None  # whole words only
    assert split_of("part-0.jsonl") is None


def test_dataset_notes_name_skipped_files_and_several_splits(tmp_path):
    hub = tmp_path / "hub"  # as `hf download --repo-type dataset` leaves a dataset
    for rel in [
        "README.md",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test-00000-of-00001.parquet",
    ]:
        (hub / rel).parent.mkdir(parents=True, exist_ok=True)
        (hub / rel).write_text("x")
    assert dataset_notes(hub, "--data", "s3://b/hub") == [
        "--data s3://b/hub: skipped 1 file(s) that are not data (.jsonl, .json, .parquet, "
        ".arrow or .txt; .jsonl, .json and .txt also .gz, .bz2, .xz or .zst): README.md",
        "--data s3://b/hub: its 3 files are named for several splits (2 train: "
        "data/train-00000-of-00002.parquet, ...; 1 test: data/test-00000-of-00001.parquet), "
        "and every one is read: to use one split, give --data that split's file or a directory "
        "of its files alone",
    ]
    # one split, or none named: nothing to say; nor of a single file
    train = hub / "data" / "train-00000-of-00002.parquet"
    assert dataset_notes(tmp_path / "none", "--data", "x") == []
    (hub / "README.md").unlink()
    (hub / "data" / "test-00000-of-00001.parquet").unlink()
    assert dataset_notes(hub, "--data", str(hub)) == []
    assert dataset_notes(train, "--data", str(train)) == []


def test_eval_files_that_are_training_files_are_named(tmp_path):
    train = write_jsonl(tmp_path / "train" / "a.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "train" / "b.jsonl", [{"text": "b"}])
    (tmp_path / "eval").mkdir()
    write_jsonl(tmp_path / "eval" / "c.jsonl", [{"text": "c"}])
    assert not_held_out_notes(tmp_path / "train", tmp_path / "eval", "e") == []
    (tmp_path / "eval" / "a.jsonl").symlink_to(train)  # the same file, reached another way
    want = [
        f"--eval-data e: 1 of its files are --data's too, so its loss is not held out ({train}): "
        "give files the run does not train on, or --eval-split"
    ]
    assert not_held_out_notes(tmp_path / "train", tmp_path / "eval", "e") == want
    assert not_held_out_notes(tmp_path / "train", train, "e") == want
    assert not_held_out_notes(train, tmp_path / "train" / ".." / "train" / "a.jsonl", "e") == want


# -- compressed files and .json ------------------------------------------------------------


def compress(path: Path, data: bytes) -> Path:
    """`data` written to `path`, compressed as its last suffix says (the standard library's
    gzip, bz2 and lzma; zstd through pyarrow, checked by its frame's magic number)."""
    import bz2
    import gzip
    import lzma

    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".zst":
        with pa.output_stream(str(path), compression="zstd") as out:
            out.write(data)
        assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    else:
        path.write_bytes({".gz": gzip, ".bz2": bz2, ".xz": lzma}[suffix].compress(data))
    return path


def texts(files: list[Path], worker: int = 0, workers: int = 1) -> list[str]:
    return [parse_document(d).text for d in ShardReader(files, worker, workers)]


@pytest.mark.parametrize("codec", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_files_read_as_the_plain_ones(tmp_path, codec):
    records = [{"text": f"doc {i} \u00e9\u4e2d"} for i in range(7)]
    plain = write_jsonl(tmp_path / "plain" / "a.jsonl", records, blank_lines=True)
    (tmp_path / "plain" / "b.txt").write_text("a whole file\nis one document\n")
    packed = tmp_path / "packed"
    compress(packed / f"a.jsonl{codec}", plain.read_bytes())
    compress(packed / f"b.txt{codec}", (tmp_path / "plain" / "b.txt").read_bytes())
    compress(packed / f"c.json{codec}", json.dumps(records[:2], indent=2).encode())
    files = find_data_files(packed)
    assert [f.name for f in files] == [f"a.jsonl{codec}", f"b.txt{codec}", f"c.json{codec}"]
    want = texts(find_data_files(tmp_path / "plain")) + [r["text"] for r in records[:2]]
    assert len(want) == 10 and texts(files) == want
    for w in range(3):  # shards as for any file: by global index, located by line
        assert texts(files, w, 3) == want[w::3]
    assert next(iter(ShardReader(files, 1, 3))).where == f"{files[0]}:3"


def test_a_damaged_compressed_file_is_named(tmp_path):
    import gzip

    good = gzip.compress(b"".join(b'{"text": "d%d"}\n' % i for i in range(2000)))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(good[: len(good) // 2])  # an interrupted download
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot read: .*damaged or truncated"):
        list(ShardReader([cut], 0, 1))
    fake = tmp_path / "fake.jsonl.zst"
    fake.write_text('{"text": "not compressed at all"}\n')
    with pytest.raises(DataError, match=r"fake\.jsonl\.zst: cannot read: "):
        find_data_files(fake)


def test_a_json_file_is_an_array_of_records_or_json_lines(tmp_path):
    array = tmp_path / "array.json"
    items = [{"text": "a"}, {"prompt": "p", "completion": "c"}, ["x"], {"text": "d"}]
    array.write_text("\ufeff\n  " + json.dumps(items, indent=2))  # a byte-order mark, blanks
    docs = list(ShardReader([array], 0, 1))
    assert [d.where for d in docs] == [f"{array}:[{i}]" for i in range(4)]
    assert parse_document(docs[1]) == Record(prompt="p", completion="c")
    with pytest.raises(DataError, match=r"array\.json:\[2\]: expected a JSON object, found an"):
        parse_document(docs[2])
    assert [d.doc for d in ShardReader([array], 1, 2)] == [0, 1]
    assert [d.where for d in ShardReader([array], 1, 2, start_doc=1)] == [f"{array}:[3]"]

    lines = write_jsonl(tmp_path / "lines.json", [{"text": "l0"}, {"text": "l1"}])
    both = list(ShardReader([lines, array], 0, 1))
    assert [parse_document(d).text for d in both[:2]] == ["l0", "l1"]
    assert [d.where for d in both] == [f"{lines}:1", f"{lines}:2", *(d.where for d in docs)]

    (tmp_path / "empty.json").write_text("[]\n")
    assert not has_documents([tmp_path / "empty.json"])
    with pytest.raises(DataError, match=r"^empty dataset: no documents in .*empty\.json"):
        find_data_files(tmp_path / "empty.json")

    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"text": "a"},\n  {"text": "b"\n]\n')
    with pytest.raises(
        DataError, match=r"broken\.json: malformed JSON array: Expecting ',' delimiter at line 4"
    ):
        find_data_files(broken)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'[{"text": "caf\xe9"}]')
    with pytest.raises(DataError, match=r"latin1\.json: not valid UTF-8 \(invalid continuation"):
        find_data_files(latin1)
    one_object = tmp_path / "squad.json"
    one_object.write_text(json.dumps({"data": [{"text": "a"}]}, indent=2))
    with pytest.raises(DataError) as e:
        find_data_files(one_object)
    assert str(e.value).startswith(f"{one_object}:1: not JSON (")
    assert str(e.value).endswith(
        "a .json dataset is JSON Lines (one record a line) or one JSON array of records"
    )


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
            b'{"instruction": "a", "input": "", "output": "b"}',
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", '
            '"conversations"); keys found: "input", "instruction", "output" (an Alpaca-style '
            'record: write it as "prompt" + "completion", the prompt being the instruction and '
            'input in the template you want, or as "messages")',
        ),
        (
            b"{}",
            'd.jsonl:7: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: none',
        ),
        (b'{"text": 5}', 'd.jsonl:7: "text" must be a string, found a number'),
        (
            b'{"prompt": "a", "completion": null}',
            'd.jsonl:7: "completion" must be a string, found null',
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
    ]
    (ids0, m0), (ids1, m1), (ids2, m2) = encode_records(t, records, eos)
    assert ids0.tolist() == t.encode("the cat sat").ids + [eos] and ids0[0] == bos
    assert m0.all() and ids0.dtype == np.int64
    p = t.encode("the dog").ids
    c = t.encode("ran far away", add_special_tokens=False).ids
    assert ids1.tolist() == p + c + [eos]
    assert m1.tolist() == [False] * len(p) + [True] * (len(c) + 1)
    assert ids2.tolist() == [bos, eos] and m2.all()
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
