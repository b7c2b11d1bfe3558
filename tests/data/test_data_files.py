"""appliance.data.files: which files are data, each format read (compressed, .json arrays,
tables), and what a run says about a dataset directory (files skipped, several splits, eval files
it trains on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.data.files import count_documents, has_documents, is_json_array, json_array_items
from appliance.data.listing import (
    dataset_notes,
    find_data_files,
    not_held_out_notes,
    split_of,
    unreadable_files,
)
from appliance.data.records import Record, ShardReader, parse_document
from appliance.errors import DataError
from tests.helpers_data import write_jsonl


def write_files(root: Path, names: list[str], text: str = "x") -> None:
    """Files `names` (relative paths) under `root`, each holding `text`."""
    for rel in names:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


# -- discovery -------------------------------------------------------------------------------


def test_find_data_files_is_recursive_sorted_and_ignores_other_files(tmp_path):
    names = [
        *("b.jsonl", "a/z.txt", "a/y.jsonl", "c.md", "a/notes.json", "a/b/x.TXT", "0.txt"),
        *("d.jsonl.gz", "e.xlsx.gz", "f.parquet.gz", "a/dataset_info.json", "t.txt.zst"),
        *("g.arrow", "h.arrow.gz", "a/state.json"),
    ]
    write_files(tmp_path, names)
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
    # datasets' metadata beside the data is not data; nor is a spreadsheet or a compressed .parquet
    assert unreadable_files(tmp_path) == [
        "a/dataset_info.json",
        "a/state.json",
        "c.md",
        "e.xlsx.gz",
        "f.parquet.gz",
        "h.arrow.gz",
    ]


def test_a_directorys_hidden_files_are_not_its_data(tmp_path):
    """A notebook's checkpoint copy, macOS's `._` files, a `.cache/`: skipped and named, as a
    pattern's `*` skips them."""
    hidden = [".ipynb_checkpoints/train-checkpoint.jsonl", "._train.jsonl", ".cache/x/part.jsonl"]
    write_files(tmp_path, ["train.jsonl", *hidden, ".git/HEAD"], '{"text": "x"}\n')
    assert find_data_files(tmp_path) == [tmp_path / "train.jsonl"]
    assert find_data_files(tmp_path / "*") == [tmp_path / "train.jsonl"]
    assert unreadable_files(tmp_path) == []  # (.git/HEAD is not named as skipped data either)
    assert dataset_notes(tmp_path, "--data", "d") == [
        "--data d: skipped 3 hidden file(s): ._train.jsonl, .cache/x/part.jsonl, "
        ".ipynb_checkpoints/train-checkpoint.jsonl"
    ]
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(DataError, match=r"\(skipped 3 hidden file\(s\): \._train\.jsonl, "):
        find_data_files(tmp_path)
    # a directory given by a hidden path is read as any other
    assert find_data_files(tmp_path / ".cache") == [tmp_path / ".cache" / "x" / "part.jsonl"]


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
        "empty dataset: no data files (.jsonl, .json, .parquet, .arrow, .csv, .tsv or .txt; all "
        f"but .parquet and .arrow also .gz, .bz2, .xz or .zst) under {tmp_path} (skipped 1 other file(s): "
        "readme.md)"
    )


def test_unsupported_single_file(tmp_path):
    (tmp_path / "d.xlsx").write_text("a,b")
    with pytest.raises(
        DataError,
        match=r"unsupported dataset file .*d\.xlsx: expected a data file \(\.jsonl, \.json,",
    ):
        find_data_files(tmp_path / "d.xlsx")


def test_has_documents(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    assert not has_documents([empty])
    assert has_documents([empty, write_jsonl(tmp_path / "f.jsonl", [{"text": "a"}])])
    (tmp_path / "t.txt").write_text("")
    assert has_documents([tmp_path / "t.txt"])  # a .txt file is a document even if empty
    # counted up to a limit (a default tokenizer-worker count's cap): no further is read
    more = write_jsonl(tmp_path / "g.jsonl", [{"text": str(i)} for i in range(9)])
    (tmp_path / "h.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert count_documents([empty, tmp_path / "t.txt", tmp_path / "h.json"], 10) == 3
    assert count_documents([more, tmp_path / "t.txt"], 4) == 4
    assert count_documents([more, tmp_path / "t.txt"], 100) == 10
    assert count_documents([empty], 4) == 0


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
    write_files(
        hub,
        [
            "README.md",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/test-00000-of-00001.parquet",
        ],
    )
    assert dataset_notes(hub, "--data", "s3://b/hub") == [
        "--data s3://b/hub: skipped 1 file(s) that are not data (.jsonl, .json, .parquet, "
        ".arrow, .csv, .tsv or .txt; all but .parquet and .arrow also .gz, .bz2, .xz or .zst): "
        "README.md",
        "--data s3://b/hub: its 3 files are named for several splits (2 train: "
        "data/train-00000-of-00002.parquet, ...; 1 test: data/test-00000-of-00001.parquet), "
        "and every one is read: to use one split, give --data its files alone (e.g. --data "
        "'s3://b/hub/data/train*')",
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

    # an array is parsed item by item as it is read: a fault is named where the reader meets it
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"text": "a"},\n  {"text": "b"\n]\n')
    assert find_data_files(broken) == [broken]
    with pytest.raises(
        DataError,
        match=r"broken\.json: malformed JSON array: Expecting ',' delimiter at line 4 column 1$",
    ):
        list(ShardReader([broken], 0, 1))
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


ITEMS = [
    {"text": "caf\u00e9 \u4e2d\u6587 \U0001f600", "n": 12345678901234567890, "f": -1.5e-300},
    {"messages": [{"role": "user", "content": 'say "hi"\\n'}], "t": True, "z": None},
    "a string, ] with a bracket",
    [1, [2, [3]]],
    98765,
    {},
    [float("inf"), float("-inf"), False, 1e5, 2.5e-3, "\\", "\u00e9"],
]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_a_json_array_is_parsed_item_by_item_across_any_chunk_boundary(tmp_path, chunk):
    f = tmp_path / "a.json"
    for text in (json.dumps(ITEMS), json.dumps(ITEMS, indent=3, ensure_ascii=False)):
        f.write_text("\ufeff " + text + "\n\n", encoding="utf-8")  # multi-byte, cut anywhere
        assert is_json_array(f)
        assert list(json_array_items(f, chunk)) == ITEMS
    for text in ("[]", " [ ] ", "[\n]\n"):
        f.write_text(text)
        assert list(json_array_items(f, chunk)) == []


def test_a_malformed_item_is_named_before_the_rest_of_the_file_is_read(tmp_path):
    """The parser reads on only while an item may have been cut by the end of the text read so
    far: a malformed one near the start of a big array is named at once (the file's end, which
    is not UTF-8, is never reached), and memory holds a chunk, not the file."""
    f = tmp_path / "big.json"
    for bad, problem in [
        ('{"a": 1} {"b": 2}', "Expecting ',' delimiter at line 1 column 11"),
        ('{"a": tru}', "Expecting value at line 1 column 8"),
        ('{"a": "x\\q"}', "Invalid \\escape at line 1 column 10"),
        (
            '{"a": 1,, "b": 2}',
            "Expecting property name enclosed in double quotes at line 1 column 10",
        ),
    ]:
        body = "[" + bad + ", " + ", ".join(['{"text": "' + "x" * 100 + '"}'] * 2000)
        f.write_bytes(body.encode() + b"\xff]")
        with pytest.raises(DataError) as e:
            list(json_array_items(f, 64))
        assert str(e.value) == f"{f}: malformed JSON array: {problem}"


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[{"a": 1},\n {"b": 2}\n {"c": 3}]', "Expecting ',' delimiter at line 3 column 2"),
        ('[{"a": 1},\n {"b": 2},\n]', "Expecting value at line 3 column 1"),  # a trailing comma
        ('[{"a": 1},\n {"b": 2}', "Expecting ',' delimiter at line 2 column 10"),  # cut short
        ('[{"a": 1},\n {"b": "two', "Unterminated string starting at line 2 column 8"),
        ('[{"a": 1}]\n[{"b": 2}]', "Extra data at line 2 column 1"),
        ('[{"a": 1}, {"b" 2}]', "Expecting ':' delimiter at line 1 column 17"),
    ],
)
@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_a_malformed_json_array_is_named_at_its_line_and_column(tmp_path, text, problem, chunk):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(DataError) as e:
        list(json_array_items(f, chunk))
    assert str(e.value) == f"{f}: malformed JSON array: {problem}"
    with pytest.raises(json.JSONDecodeError) as reference:  # as json.loads words and places it
        json.loads(text)
    r = reference.value
    assert problem == f"{r.msg.removesuffix(' at')} at line {r.lineno} column {r.colno}"
