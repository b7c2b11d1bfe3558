"""Glob patterns in --data and --eval-data: the rule is glob's, on a directory and on S3 alike; a
pattern names exactly its files, in a directory's order; what it cannot name is said."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.data.listing import (
    dataset_notes,
    find_data_files,
    not_held_out_notes,
    split_of,
    split_pattern,
)
from appliance.errors import DataError, StorageError
from appliance.run.inputs import prepare
from appliance.storage import uri as storage
from appliance.storage.globs import glob_match, split_glob
from appliance.storage.localize import localize_data
from tests.helpers_data import write_jsonl
from tests.helpers_model import make_model, tiny_train_config
from tests.helpers_net import free_port
from tests.helpers_tokenizer import sentences

pytest_plugins = ["tests.s3_server"]

TREE = [
    "a.jsonl",
    "b.json",
    "notes.md",
    "data/train-0.jsonl",
    "data/train-1.jsonl.gz",
    "data/test-0.jsonl",
    "data/.hidden.jsonl",
    "data/sub/train-2.jsonl",
    "data/sub/deeper/train-3.txt",
    ".cache/x.jsonl",
    "data/.git/y.jsonl",
    "[x].jsonl",
    "q1.txt",
    "q22.txt",
]
PATTERNS = [
    "*",
    "*.jsonl",
    "*.json*",
    "data/*",
    "data/train-*",
    "data/*/train-*",
    "**",
    "**/*.jsonl",
    "data/**",
    "data/**/train-*",
    "**/sub/**",
    "q?.txt",
    "q??.txt",
    "[ab].*",
    "[!a]*.json",
    "[[]x].jsonl",
    "data/.*",
    ".*/*",
    "*/.*/*",
    "data/sub/deeper/*.txt",
    "nothing-*",
]


def make_tree(root: Path) -> None:
    for rel in TREE:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_glob_match_is_globs_own_rule(tmp_path, pattern):
    make_tree(tmp_path)
    files = {
        Path(p).relative_to(tmp_path).as_posix()
        for p in glob.glob(str(tmp_path / pattern), recursive=True)
        if Path(p).is_file()
    }
    assert {f for f in TREE if glob_match(pattern, f)} == files


def test_split_glob():
    assert split_glob("data/raw/**/*.jsonl") == ("data/raw", "**/*.jsonl")
    assert split_glob("*.jsonl") == ("", "*.jsonl")
    assert split_glob("/abs/d?/x") == ("/abs", "d?/x")
    assert split_glob("s3://b/p/train-[0-4].jsonl") == ("s3://b/p", "train-[0-4].jsonl")


def rel(files, root):
    return [f.relative_to(root).as_posix() for f in files]


def test_a_pattern_names_its_data_files_in_a_directorys_order(tmp_path):
    make_tree(tmp_path)
    assert rel(find_data_files(tmp_path / "data" / "train-*"), tmp_path) == [
        "data/train-0.jsonl",
        "data/train-1.jsonl.gz",
    ]
    # a pattern names files, not directories (as on S3); `**` any depth, hidden names never
    with pytest.raises(DataError) as e:
        find_data_files(tmp_path / "data" / "s*")  # (a directory)
    assert str(e.value) == (
        f"no file matches {tmp_path}/data/s*: it names directories only ({tmp_path}/data/sub), "
        "and a pattern names files: add /** for every file under them"
    )
    assert rel(find_data_files(tmp_path / "data" / "s*" / "**"), tmp_path) == [
        "data/sub/deeper/train-3.txt",
        "data/sub/train-2.jsonl",
    ]
    assert rel(find_data_files(tmp_path / "*"), tmp_path) == [
        "[x].jsonl",
        "a.jsonl",
        "b.json",
        "q1.txt",
        "q22.txt",
    ]
    everything = find_data_files(tmp_path / "**")
    assert rel(everything, tmp_path) == [
        "[x].jsonl",
        "a.jsonl",
        "b.json",
        "data/sub/deeper/train-3.txt",
        "data/sub/train-2.jsonl",
        "data/test-0.jsonl",
        "data/train-0.jsonl",
        "data/train-1.jsonl.gz",
        "q1.txt",
        "q22.txt",
    ]
    # the order is a directory's: the same files as a directory read the same way
    only = tmp_path / "only"
    for f in find_data_files(tmp_path / "data" / "**" / "train-*"):
        (only / f.relative_to(tmp_path)).parent.mkdir(parents=True, exist_ok=True)
        (only / f.relative_to(tmp_path)).write_text("x")
    want = rel(find_data_files(only), only)
    assert rel(find_data_files(tmp_path / "data" / "**" / "train-*"), tmp_path) == want
    # a path that exists is never a pattern, even with a wildcard in its name
    assert find_data_files(tmp_path / "[x].jsonl") == [tmp_path / "[x].jsonl"]


def test_a_pattern_that_names_nothing_or_no_data_is_named(tmp_path):
    make_tree(tmp_path)
    with pytest.raises(DataError, match=r"no file matches .*/nothing-\*: check the pattern"):
        find_data_files(tmp_path / "nothing-*")
    with pytest.raises(DataError) as e:
        find_data_files(tmp_path / "*.md")
    assert str(e.value) == (
        f"empty dataset: no data files (.jsonl, .json, .parquet, .arrow, .csv, .tsv or .txt; all "
        f"but .parquet and .arrow also .gz, .bz2, .xz or .zst) match {tmp_path}/*.md (it matched 1 other "
        f"file(s): {tmp_path}/notes.md)"
    )
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "e.jsonl").write_text("\n \n")
    with pytest.raises(DataError, match=r"empty dataset: no documents in .*/blank/\*\.jsonl"):
        find_data_files(tmp_path / "blank" / "*.jsonl")


def test_braces_are_named_as_the_shells_not_a_pattern(tmp_path, s3_bucket, s3_client):
    """`part-{0,1}.jsonl` quoted reaches the appliance as it is, and names nothing: each error
    says what to write instead, locally and on S3, with a wildcard beside the braces or not."""

    def hint(braces: str) -> str:
        return (
            f"; {braces} is the shell's brace expansion, not a pattern here: name the files with "
            "* or [...] (part-[01].jsonl), or give their directory"
        )

    write_jsonl(tmp_path / "part-0.jsonl", [{"text": "a"}])
    with pytest.raises(DataError) as e:
        find_data_files(tmp_path / "part-{0,1}.jsonl")
    assert str(e.value) == f"dataset not found: {tmp_path}/part-{{0,1}}.jsonl" + hint("{0,1}")
    with pytest.raises(DataError) as e:
        find_data_files(tmp_path / "part-{0,1}*")
    assert str(e.value).startswith(f"no file matches {tmp_path}/part-{{0,1}}*: check the pattern")
    assert str(e.value).endswith(hint("{0,1}"))
    with pytest.raises(StorageError) as e:
        localize_data(str(tmp_path / "{a,b}" / "*.jsonl"))
    assert str(e.value).startswith(f"no such directory: {tmp_path}/{{a,b}} (the part of")
    assert str(e.value).endswith(hint("{a,b}"))
    s3_client.put_object(Bucket=s3_bucket, Key="d/part-0.jsonl", Body=b'{"text": "a"}\n')
    for uri in (f"s3://{s3_bucket}/d/part-{{0,1}}.jsonl", f"s3://{s3_bucket}/d/part-{{0,1}}*"):
        with pytest.raises(StorageError) as e:
            localize_data(uri, cache_dir=tmp_path / "cache")
        assert str(e.value).startswith(("nothing at " + uri, "nothing matches " + uri)), e.value
        assert str(e.value).endswith(hint("{0,1}"))
    # no braces, no hint; and a comma alone is no brace expansion
    with pytest.raises(DataError, match=r"^dataset not found: .*/a,b$"):
        find_data_files(tmp_path / "a,b")


def test_notes_of_a_pattern(tmp_path):
    make_tree(tmp_path)
    notes = dataset_notes(tmp_path / "**", "--data", "X")
    assert notes[0].startswith("--data X: skipped 1 file(s) that are not data (")
    assert notes[0].endswith("): notes.md")
    assert notes[1].startswith(
        "--data X: its 10 files are named for several splits (4 train: "
        "data/sub/deeper/train-3.txt, ...; 1 test: data/test-0.jsonl), and every one is read"
    )
    assert dataset_notes(tmp_path / "data" / "**" / "train-*", "--data", "X") == []
    # --eval-data sharing files with a --data pattern is named; a disjoint pattern is not
    train, test = tmp_path / "data" / "**" / "train-*", tmp_path / "data" / "test-*"
    assert not_held_out_notes(train, test, "E") == []
    shared = not_held_out_notes(tmp_path / "data" / "**", test, "E")
    assert shared == [
        f"--eval-data E: 1 of its files are --data's too, so its loss is not held out "
        f"({tmp_path / 'data' / 'test-0.jsonl'}): give files the run does not train on, or "
        "--eval-split"
    ]


def test_a_local_pattern_is_checked_to_its_first_wildcard(tmp_path):
    make_tree(tmp_path)
    pattern = str(tmp_path / "data" / "train-*")
    assert localize_data(pattern) == Path(pattern)
    with pytest.raises(StorageError, match=r"no such directory: .*/missing \(the part of"):
        localize_data(str(tmp_path / "missing" / "*.jsonl"))


def test_a_run_prepared_on_patterns_reads_their_files(tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    write_jsonl(tmp_path / "ds" / "train-0.jsonl", [{"text": s} for s in sentences(6)])
    write_jsonl(tmp_path / "ds" / "val-0.jsonl", [{"text": s} for s in sentences(3, seed=2)])
    cfg = tiny_train_config(
        model,
        tmp_path / "ds" / "train-*",
        tmp_path / "out",
        steps=1,
        eval_data=str(tmp_path / "ds" / "val-*"),
    )
    inp = prepare(cfg)
    assert inp.data_path == tmp_path / "ds" / "train-*"
    assert inp.eval_data == tmp_path / "ds" / "val-*"
    assert inp.notes == []
    cfg = tiny_train_config(model, tmp_path / "ds" / "nothing-*", tmp_path / "out", steps=1)
    with pytest.raises(DataError, match="no file matches"):
        prepare(cfg)


# -- S3 ------------------------------------------------------------------------------------


def test_an_s3_pattern_downloads_only_what_it_matches(s3_bucket, s3_client, tmp_path):
    for key in ["d/train-0.jsonl", "d/train-1.jsonl", "d/sub/train-2.jsonl", "d/test-0.jsonl"]:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=key.encode())
    cache = tmp_path / "cache"

    def cached():
        root = cache / s3_bucket
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

    path = localize_data(f"s3://{s3_bucket}/d/train-*", cache_dir=cache)
    assert path == cache / s3_bucket / "d" / "train-*"
    assert cached() == ["d/train-0.jsonl", "d/train-1.jsonl"]
    assert rel(find_data_files(path), cache / s3_bucket) == cached()

    # another pattern over the same prefix adds its files and leaves the first one's alone
    localize_data(f"s3://{s3_bucket}/d/**/*.jsonl", cache_dir=cache)
    assert cached() == [
        "d/sub/train-2.jsonl",
        "d/test-0.jsonl",
        "d/train-0.jsonl",
        "d/train-1.jsonl",
    ]
    # an object gone from S3 is gone from the cache when a pattern that names it is localized
    s3_client.delete_object(Bucket=s3_bucket, Key="d/train-1.jsonl")
    localize_data(f"s3://{s3_bucket}/d/test-*", cache_dir=cache)
    assert "d/train-1.jsonl" in cached()  # not this pattern's
    localize_data(f"s3://{s3_bucket}/d/train-*", cache_dir=cache)
    assert "d/train-1.jsonl" not in cached()

    with pytest.raises(StorageError) as e:
        localize_data(f"s3://{s3_bucket}/d/valid-*", cache_dir=cache)
    assert str(e.value).startswith(
        f"nothing matches s3://{s3_bucket}/d/valid-*: no object under s3://{s3_bucket}/d/ has a "
        "name that matches valid-*; check the pattern"
    )
    with pytest.raises(StorageError, match="the bucket's name cannot be a pattern"):
        localize_data("s3://buck*/d/x.jsonl", cache_dir=cache)


def test_an_s3_key_that_holds_wildcards_is_read_under_its_own_name(s3_bucket, s3_client, tmp_path):
    # `[1]` as a pattern matches `part1.jsonl`; the object named `part[1].jsonl` is the one meant
    for key in ["d/part[1].jsonl", "d/part1.jsonl", "e*/a.jsonl"]:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=key.encode())
    cache = tmp_path / "cache"
    path = localize_data(f"s3://{s3_bucket}/d/part[1].jsonl", cache_dir=cache)
    assert path == cache / s3_bucket / "d" / "part[1].jsonl"
    assert path.read_bytes() == b"d/part[1].jsonl"
    assert find_data_files(path) == [path]
    assert not (cache / s3_bucket / "d" / "part1.jsonl").exists()
    # a prefix too: `e*` is a "directory" of that name
    path = localize_data(f"s3://{s3_bucket}/e*", cache_dir=cache)
    assert path == cache / s3_bucket / "e*"
    assert find_data_files(path) == [path / "a.jsonl"]
    # what does not exist under its name is still a pattern: `[1]` matches `1`
    path = localize_data(f"s3://{s3_bucket}/d/part[1]*", cache_dir=cache)
    assert find_data_files(path) == [cache / s3_bucket / "d" / "part1.jsonl"]
    with pytest.raises(StorageError, match="nothing matches"):
        localize_data(f"s3://{s3_bucket}/d/part[2-9]*", cache_dir=cache)


@pytest.mark.integration
def test_train_on_s3_patterns_reads_only_the_files_they_name(s3_endpoint, s3_bucket, tmp_path):
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data"
    write_jsonl(data / "train-0.jsonl", [{"text": s} for s in sentences(30)])
    write_jsonl(data / "train-1.jsonl", [{"text": s} for s in sentences(30, seed=1)])
    write_jsonl(data / "val.jsonl", [{"text": s} for s in sentences(8, seed=2)])
    (data / "test-broken.jsonl").write_text("{not json\n")  # fails the run if it is read
    for f in data.iterdir():
        storage.upload_file(str(f), f"s3://{s3_bucket}/ds/{f.name}")
    home = tmp_path / "home"  # the S3 cache goes under $HOME/.cache/appliance/s3
    out = tmp_path / "out"
    argv = [
        *(sys.executable, "-m", "appliance", "train", "--model", str(model)),
        *("--data", f"s3://{s3_bucket}/ds/train-*", "--eval-data", f"s3://{s3_bucket}/ds/val*"),
        *("--output", str(out), "--steps", "4", "--seq-len", "16", "--micro-batch-size", "2"),
        *("--lora-rank", "4", "--tokenize-workers", "1", "--on-bad-record", "fail"),
        *("--log-format", "json", "--metrics-port", str(free_port())),
    ]
    proc = subprocess.run(
        argv, env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["steps"] == 4
    assert run["config"]["data"] == f"s3://{s3_bucket}/ds/train-*"
    cache = home / ".cache" / "appliance" / "s3" / s3_bucket / "ds"
    assert sorted(p.name for p in cache.iterdir()) == [
        "train-0.jsonl",
        "train-1.jsonl",
        "val.jsonl",
    ]
    assert "eval_loss" in proc.stdout


def test_the_pattern_a_split_note_suggests_names_that_split_alone():
    hub = ["README.md", "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    hub.append("data/test-00000-of-00001.parquet")
    assert split_pattern("train", hub) == "data/train*"
    assert split_pattern("test", hub) == "data/test*"
    dirs = ["dev/part-0.jsonl", "dev/part-1.jsonl", "train/part-0.jsonl", "Train.jsonl"]
    assert split_pattern("validation", dirs) == "dev/**"
    assert split_pattern("train", dirs) is None  # train/** misses Train.jsonl, Train* train/...
    assert split_pattern("train", ["A/TRAIN-0.txt", "A/eval.txt"]) == "A/TRAIN*"
    for files in (hub, dirs):
        for split in ("train", "validation", "test"):
            if (pattern := split_pattern(split, files)) is not None:
                assert {f for f in files if glob_match(pattern, f)} == {
                    f for f in files if split_of(f) == split
                }
    # an --eval-data note points to the validation split first
    notes = dataset_notes_of(["train-0.jsonl", "valid-0.jsonl", "test-0.jsonl"], "--eval-data")
    assert notes[-1].endswith("(e.g. --eval-data 'E/valid*')")
    notes = dataset_notes_of(["train-0.jsonl", "valid-0.jsonl", "test-0.jsonl"], "--data")
    assert notes[-1].endswith("(e.g. --data 'E/train*')")


def dataset_notes_of(names, flag):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name in names:
            (Path(d) / name).write_text("x")
        return dataset_notes(d, flag, "E")
