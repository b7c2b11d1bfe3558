"""TokenizeWorker: packing, masking, sharding, cursors, bad input; directly and through Ray."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from appliance.actors.tokenize_worker import ACTOR_OPTIONS, TokenizeWorker, default_num_workers
from appliance.data.files import DATA_FILES
from appliance.data.listing import file_names
from appliance.data.records import SKIP_HINT, Batch, DataError, check_dataset
from appliance.models.layers import IGNORE_INDEX
from tests.helpers_ray import ray_session
from tests.helpers_tokenizer import make_tokenizer, sentences


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """(tokenizer.json path, bos, eos, pad) of the tiny test tokenizer."""
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path.write_text(text)
    return path


def make_dataset(root: Path, n: int = 40, seed: int = 1) -> list[dict]:
    """A directory dataset of text and prompt/completion records spread over .jsonl and .txt
    files, with blank lines and files to ignore. Returns the documents in global order."""
    texts = sentences(2 * n, seed=seed)
    docs: list[dict] = []
    for i in range(n):
        if i % 3 == 2:
            docs.append({"prompt": texts[2 * i], "completion": texts[2 * i + 1]})
        else:
            docs.append({"text": texts[2 * i]})
    a, b = n // 2, n // 2 + 1
    write_jsonl(root / "a.jsonl", [json.dumps(d) for d in docs[:a]] + [""])  # trailing blank
    (root / "b" / "doc.txt").parent.mkdir(parents=True)
    (root / "b" / "doc.txt").write_text(docs[a]["text"] if "text" in docs[a] else "the cat")
    docs[a] = {"text": (root / "b" / "doc.txt").read_text()}
    write_jsonl(root / "c" / "d.jsonl", [json.dumps(docs[b]), "  "] + docs[b + 1 :])
    (root / "c" / "ignored.md").write_text("not data")
    return docs


def doc_stream(t: Tokenizer, doc: dict, eos: int) -> tuple[list[int], list[bool]]:
    """The packing rule, written out independently of appliance.data.records."""
    if "text" in doc:
        ids = t.encode(doc["text"]).ids + [eos]
        return ids, [True] * len(ids)
    p = t.encode(doc["prompt"]).ids
    c = t.encode(doc["completion"], add_special_tokens=False).ids + [eos]
    return p + c, [False] * len(p) + [True] * len(c)


def shard_stream(t, docs, eos, w, n) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    mask: list[bool] = []
    for d in docs[w::n]:
        i, m = doc_stream(t, d, eos)
        ids += i
        mask += m
    return np.array(ids), np.array(mask)


def all_batches(worker: TokenizeWorker, limit: int = 10_000) -> list[Batch]:
    out = []
    while (b := worker.next_batch()) is not None:
        out.append(b)
        assert len(out) < limit
    return out


def assert_same_batches(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.input_ids, w.input_ids)
        np.testing.assert_array_equal(g.labels, w.labels)
        assert (g.cursor, g.epoch, g.n_tokens, g.skipped_records, g.worker) == (
            w.cursor,
            w.epoch,
            w.n_tokens,
            w.skipped_records,
            w.worker,
        )


@pytest.fixture
def data(tmp_path, tok):
    root = tmp_path / "data"
    docs = make_dataset(root)
    return root, docs


def new_worker(data_path, tok, w=0, n=1, seq_len=8, mbs=3, **kw) -> TokenizeWorker:
    """A worker with the stream packing these tests spell out (documents: tests/data/test_packing.py)."""
    path, _, eos, pad = tok
    kw.setdefault("packing", "stream")
    return TokenizeWorker(str(data_path), path, w, n, seq_len, mbs, eos, pad, **kw)


# -- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_empty_and_blank_texts_are_not_trained_on(tmp_path, tok, packing):
    """wikitext-style rows ("", " \\n") between the documents: the batches are those of the
    documents alone (no BOS -> EOS pairs teaching the model to stop at once)."""
    texts = sentences(12, seed=4)
    with_empty = [x for t in texts for x in ({"text": t}, {"text": ""}, {"text": " \n "})]
    write_jsonl(tmp_path / "a" / "d.jsonl", with_empty)
    write_jsonl(tmp_path / "b" / "d.jsonl", [{"text": t} for t in texts])
    got = all_batches(new_worker(tmp_path / "a", tok, packing=packing))
    want = all_batches(new_worker(tmp_path / "b", tok, packing=packing))
    assert len(got) == len(want) > 1
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.input_ids, w.input_ids)
        np.testing.assert_array_equal(g.labels, w.labels)


@pytest.mark.parametrize("seq_len, mbs", [(8, 3), (1, 1), (16, 4), (1000, 2)])
def test_rows_follow_the_packing_rule_exactly(data, tok, seq_len, mbs):
    root, docs = data
    path, _, eos, pad = tok
    ids, mask = shard_stream(Tokenizer.from_file(path), docs, eos, 0, 1)
    batches = all_batches(new_worker(root, tok, seq_len=seq_len, mbs=mbs))
    S = seq_len
    n_rows = -(-(len(ids) - 1) // S)  # ceil: every stream token after the first is a target
    assert len(batches) == -(-n_rows // mbs)
    inputs = np.concatenate([b.input_ids for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    for b in batches:
        assert b.input_ids.shape == b.labels.shape == (mbs, S)
        assert b.input_ids.dtype == b.labels.dtype == np.int64
        assert b.n_tokens == int((b.labels != IGNORE_INDEX).sum())
        assert (b.epoch, b.worker, b.pid, b.skipped_records) == (0, 0, os.getpid(), 0)
    for k in range(n_rows):
        row = ids[k * S : k * S + S + 1]
        want_in = np.full(S, pad)
        want_in[: len(row) - 1] = row[:-1]
        want_lab = np.full(S, IGNORE_INDEX)
        want_lab[: len(row) - 1] = np.where(mask[k * S + 1 : k * S + len(row)], row[1:], -100)
        np.testing.assert_array_equal(inputs[k], want_in, err_msg=f"row {k}")
        np.testing.assert_array_equal(labels[k], want_lab, err_msg=f"row {k}")
    # The epoch's last batch is padded with fully masked rows.
    assert (inputs[n_rows:] == pad).all() and (labels[n_rows:] == IGNORE_INDEX).all()
    assert batches[-1].cursor == {
        "epoch": 1,
        "doc": 0,
        "offset": 0,
        "skipped": 0,
        "worker": 0,
        "num_workers": 1,
    }


def test_prompt_tokens_are_never_targets(tmp_path, tok):
    path, bos, eos, pad = tok
    t = Tokenizer.from_file(path)
    recs = [{"prompt": "the cat sat", "completion": "on the mat"}, {"text": "big dog"}]
    write_jsonl(tmp_path / "d.jsonl", recs)
    [b] = all_batches(new_worker(tmp_path / "d.jsonl", tok, seq_len=16, mbs=1))
    p = t.encode("the cat sat").ids  # [BOS, the, cat, sat]
    c = t.encode("on the mat", add_special_tokens=False).ids
    text = t.encode("big dog").ids + [eos]
    n = len(p) + len(c) + 1 + len(text)
    assert b.input_ids[0, : n - 1].tolist() == (p + c + [eos] + text)[:-1]
    # Inputs p[0..2] predict p[1..3] (prompt: no loss); then the completion and its EOS; the
    # text document's tokens, BOS included, are all targets.
    assert b.labels[0, : n - 1].tolist() == [-100] * (len(p) - 1) + c + [eos] + text
    assert (b.labels[0, n - 1 :] == -100).all() and b.n_tokens == len(c) + 1 + len(text)
    assert text[0] == bos


def test_every_token_is_a_target_once_per_epoch_across_three_workers(data, tok):
    root, docs = data
    path, _, eos, _ = tok
    t = Tokenizer.from_file(path)
    n, epochs = 3, 2
    targets_by_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    for w in range(n):
        ids, mask = shard_stream(t, docs, eos, w, n)
        batches = all_batches(new_worker(root, tok, w, n, seq_len=5, mbs=2, epochs=epochs))
        assert {b.worker for b in batches} == {w}
        for e in range(epochs):
            labels = np.concatenate([b.labels for b in batches if b.epoch == e]).ravel()
            got = labels[labels != IGNORE_INDEX]
            # In order: the shard's stream minus its first token, prompt tokens left out.
            np.testing.assert_array_equal(got, ids[1:][mask[1:]])
            targets_by_epoch[e].update(got.tolist())
            if mask[0]:
                targets_by_epoch[e][int(ids[0])] += 1  # the one token that is never a target
    every_token = Counter()
    for d in docs:
        i, m = doc_stream(t, d, eos)
        every_token.update(x for x, keep in zip(i, m, strict=True) if keep)
    assert targets_by_epoch[0] == every_token
    assert targets_by_epoch[1] == every_token


def test_epochs_none_loops_forever_with_identical_epochs(data, tok):
    root, _ = data
    one = all_batches(new_worker(root, tok, seq_len=8, mbs=4, epochs=1))
    w = new_worker(root, tok, seq_len=8, mbs=4, epochs=None)
    looped = [w.next_batch() for _ in range(3 * len(one))]
    for e in range(3):
        chunk = looped[e * len(one) : (e + 1) * len(one)]
        assert {b.epoch for b in chunk} == {e}
        for a, b in zip(chunk, one, strict=True):
            np.testing.assert_array_equal(a.input_ids, b.input_ids)
            np.testing.assert_array_equal(a.labels, b.labels)
    assert w.cursor()["epoch"] == 3


def test_finished_worker_keeps_returning_none(data, tok):
    w = new_worker(data[0], tok, seq_len=64, mbs=8)
    assert all_batches(w)
    assert w.next_batch() is None and w.next_batch() is None


# -- cursors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("w, n", [(0, 1), (1, 3)])
def test_resume_from_any_cursor_reproduces_the_rest(data, tok, w, n):
    root, _ = data
    # Bad records in the shard, to check the skipped count survives resumes too.
    extra = ['{"text": broken', '{"title": "x"}', "[]", "{", '{"text": "a"}', "5", '{"t": 1}']
    is_bad = [True, True, True, True, False, True, True]
    with open(root / "a.jsonl", "a") as f:
        f.write("\n".join(extra) + "\n")
    first = len(data[1]) // 2  # global index of the first appended line
    bad_in_shard = sum(bad for i, bad in enumerate(is_bad) if (first + i) % n == w)
    kw = dict(w=w, n=n, seq_len=5, mbs=2, epochs=2, on_bad_record="skip")
    batches = all_batches(new_worker(root, tok, **kw))
    cursors = [b.cursor for b in batches]
    assert any(c["offset"] > 0 for c in cursors), "no mid-document cursor was tested"
    assert any(c["epoch"] == 1 and c["doc"] == 0 for c in cursors[:-1]), "no epoch boundary"
    assert bad_in_shard > 0 and batches[-1].skipped_records == bad_in_shard  # once, not per epoch
    for k, b in enumerate(batches):
        cursor = json.loads(json.dumps(b.cursor))  # as stored in a checkpoint
        assert_same_batches(
            all_batches(new_worker(root, tok, **kw, cursor=cursor)), batches[k + 1 :]
        )


def test_a_worker_given_the_runs_files_resumes_on_them_when_a_file_joined_the_directory(
    data, tok, tmp_path
):
    root, _ = data
    names = file_names(root, check_dataset(root))
    assert names == ["a.jsonl", "b/doc.txt", "c/d.jsonl"]
    kw = dict(w=1, n=2, seq_len=6, mbs=2)
    batches = all_batches(new_worker(root, tok, **kw))
    cursor = json.loads(json.dumps(batches[2].cursor))
    # a shard written into the directory mid-run, sorting before the others: it would move every
    # document the cursor counts
    write_jsonl(root / "0-new.jsonl", [{"text": s} for s in sentences(5, seed=9)])
    assert_same_batches(
        all_batches(new_worker(root, tok, **kw, cursor=cursor, files=names)), batches[3:]
    )
    moved = all_batches(new_worker(root, tok, **kw, cursor=cursor))  # the directory as it is now
    assert [b.input_ids.tolist() for b in moved] != [b.input_ids.tolist() for b in batches[3:]]
    # a pattern's files by name relative to its fixed part, a file's relative to its directory
    pattern = root / "*" / "*.jsonl"
    assert file_names(pattern, check_dataset(pattern)) == ["c/d.jsonl"]
    assert file_names(root / "a.jsonl", [root / "a.jsonl"]) == ["a.jsonl"]
    # one of the run's files gone: named, with what to do
    (root / "c" / "d.jsonl").unlink()
    with pytest.raises(DataError) as e:
        new_worker(root, tok, **kw, files=names)
    assert str(e.value) == (
        f"{root}: {root / 'c' / 'd.jsonl'} was one of its data files when the run started and is "
        "not there now: put it back, or resume the run on the data as it is now (--resume "
        "--allow-data-change)"
    )


def test_seek_repositions_a_running_worker(data, tok):
    w = new_worker(data[0], tok, seq_len=7, mbs=2, epochs=2)
    first = all_batches(w)
    w.seek(first[4].cursor)
    assert w.cursor() == first[4].cursor
    assert_same_batches(all_batches(w), first[5:])
    w.seek(new_worker(data[0], tok).cursor())  # back to the start
    assert_same_batches(all_batches(w), first)


def test_cursor_is_the_position_after_the_last_batch(data, tok):
    w = new_worker(data[0], tok, w=1, n=2)
    assert w.cursor() == {
        "epoch": 0,
        "doc": 0,
        "offset": 0,
        "skipped": 0,
        "worker": 1,
        "num_workers": 2,
    }
    b = w.next_batch()
    assert w.cursor() == b.cursor and b.cursor["doc"] > 0


def test_cursor_from_another_worker_layout_is_refused(data, tok):
    c = new_worker(data[0], tok, w=0, n=2).next_batch().cursor
    with pytest.raises(DataError) as e:
        new_worker(data[0], tok, w=0, n=3, cursor=c)
    assert str(e.value) == (
        "data cursor is for worker 0 of 2, not 0 of 3: resume with the same number of "
        "tokenizer workers"
    )
    with pytest.raises(DataError, match=r"^invalid data cursor .*expected keys"):
        new_worker(data[0], tok, cursor={"epoch": 0})
    with pytest.raises(DataError, match=r"^invalid data cursor .*\['offset'\] must be integers"):
        new_worker(data[0], tok, cursor={**c, "offset": -1})


def test_cursor_that_does_not_fit_the_data_is_refused(data, tok):
    c = new_worker(data[0], tok).next_batch().cursor
    w = new_worker(data[0], tok, cursor={**c, "offset": 10_000})
    with pytest.raises(
        DataError, match=r"^data cursor \(doc \d+, offset 10000\) of worker 0 does "
    ):
        w.next_batch()
    w = new_worker(data[0], tok, cursor={**c, "doc": 10_000})
    with pytest.raises(DataError, match="the dataset or tokenizer changed since it was saved"):
        w.next_batch()


# -- bad input -------------------------------------------------------------------------------


def test_missing_dataset(tmp_path, tok):
    with pytest.raises(DataError) as e:
        new_worker(tmp_path / "missing", tok)
    assert str(e.value) == f"dataset not found: {tmp_path / 'missing'}"


def test_directory_without_data_files(tmp_path, tok):
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(DataError) as e:
        new_worker(tmp_path, tok)
    assert str(e.value) == (
        f"empty dataset: no data files ({DATA_FILES}) under {tmp_path} "
        "(skipped 1 other file(s): notes.md)"
    )


def test_dataset_without_documents(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", ["", "  "])
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(DataError) as e:
        new_worker(tmp_path, tok)
    assert str(e.value) == (
        f"empty dataset: no documents in {tmp_path} (2 file(s), all empty or blank)"
    )


def test_missing_tokenizer(data, tmp_path):
    with pytest.raises(DataError) as e:
        TokenizeWorker(str(data[0]), str(tmp_path / "model"), 0, 1, 8, 2, 2, 0)
    assert str(e.value) == (
        f"tokenizer not found: {tmp_path / 'model'} (expected a tokenizer.json file)"
    )


def test_check_dataset_validates_up_front(data, tok, tmp_path):
    assert len(check_dataset(data[0])) == 3
    with pytest.raises(DataError, match="^dataset not found"):
        check_dataset(tmp_path / "x")


def test_malformed_jsonl_line_fails_with_file_and_line(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "", '{"text": "cat" "dog"}'])
    w = new_worker(f, tok)
    with pytest.raises(DataError) as e:
        w.next_batch()
    assert str(e.value) == (
        f"{f}:3: malformed JSON: Expecting ',' delimiter at column 16 ({SKIP_HINT})"
    )


def test_bad_record_in_another_shard_is_not_this_workers_concern(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}, "{oops", {"text": "a dog"}])
    assert all_batches(new_worker(f, tok, w=0, n=2))  # docs 0 and 2
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        new_worker(f, tok, w=1, n=2).next_batch()


def test_record_without_text_names_the_keys_found(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"input": "q", "output": "a"}])
    with pytest.raises(DataError) as e:
        all_batches(new_worker(f, tok))
    assert str(e.value) == (
        f'{f}:2: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: "input", "output" ({SKIP_HINT})'
    )


def test_non_utf8_jsonl_line_and_txt_file(tmp_path, tok):
    f = tmp_path / "j" / "d.jsonl"
    f.parent.mkdir()
    f.write_bytes(b'{"text": "the cat"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        all_batches(new_worker(f, tok))
    assert str(e.value) == (
        f"{f}:2: not valid UTF-8 (invalid continuation byte at byte 13) ({SKIP_HINT})"
    )
    t = tmp_path / "t" / "doc.txt"
    t.parent.mkdir()
    t.write_bytes(b"the cat \xff sat")
    with pytest.raises(DataError) as e:
        all_batches(new_worker(t.parent, tok))
    assert str(e.value) == f"{t}: not valid UTF-8 (invalid start byte at byte 8) ({SKIP_HINT})"


def test_skip_counts_bad_records_in_batches_and_stats(tmp_path, tok):
    path, _, eos, _ = tok
    (tmp_path / "a.txt").write_bytes(b"bad \xff")  # doc 0
    write_jsonl(
        tmp_path / "b.jsonl",
        [{"text": "the cat sat"}, "{bad", {"text": "a dog ran"}, {"meta": 1}],  # docs 1-4
    )
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "red \xc0 sun"}\n{"text": "big tree"}\n')
    w = new_worker(tmp_path, tok, seq_len=4, mbs=1, on_bad_record="skip")
    batches = all_batches(w)
    t = Tokenizer.from_file(path)
    good = ["the cat sat", "a dog ran", "big tree"]
    stream = [x for s in good for x in t.encode(s).ids + [eos]]
    got = np.concatenate([b.labels.ravel() for b in batches])
    np.testing.assert_array_equal(got[got != -100], stream[1:])
    # The running count in each batch counts the bad records before the batch's cursor. Rows
    # start at stream tokens 4, 8, 12: docs 1, 3, 6 (bad before them: {0}, {0, 2},
    # {0, 2, 4, 5}); the last batch ends the epoch, past every bad record.
    assert [b.skipped_records for b in batches] == [1, 2, 4, 4]
    s = w.stats()
    assert s["skipped_records"] == 4 and s["documents"] == 3
    assert s["last_skip_reason"] == f"{tmp_path / 'c.jsonl'}:1: not valid UTF-8 " + (
        "(invalid start byte at byte 14)"
    )
    assert s["tokens"] == len(stream) and s["pid"] == os.getpid() and s["batches"] == 4
    assert s["tokens_per_second"] > 0


def test_skipped_records_are_named_with_file_line_and_problem(tmp_path, tok):
    """6 lines, 4 of them bad: the worker remembers which and why, for the run's warning, and
    names only those before a cursor (the ones a run at that cursor has counted)."""
    f = write_jsonl(
        tmp_path / "d.jsonl",
        ['{"text": "a\tb"}', {"text": "the cat sat"}, "[1]", {"body": "x"}, {"text": 5}]
        + [{"text": "a dog ran"}],
    )
    w = new_worker(f, tok, seq_len=4, mbs=1, on_bad_record="skip")
    first = w.next_batch()
    batches = [first, *all_batches(w)]
    assert batches[-1].skipped_records == 4
    assert w.skip_examples() == [
        (0, f"{f}:1: malformed JSON: Invalid control character at column 12 (a tab or other "
         "control character inside a string must be escaped: \\t)"),
        (2, f"{f}:3: expected a JSON object, found an array"),
        (3, f'{f}:4: record has no "text" (nor "prompt" + "completion", "messages", '
         '"conversations"); keys found: "body"'),
        (4, f'{f}:5: "text" must be a string, found a number'),
    ]  # fmt: skip
    # the first batch ends inside document 1: only the bad record before it was passed
    assert [g for g, _ in w.skip_examples(first.cursor)] == [0]
    assert w.skip_examples(w._cursor_at(0, 0, 0, 0)) == []


@pytest.mark.parametrize("epochs", [2, None])
def test_each_bad_record_is_counted_once_per_run_not_once_per_epoch(tmp_path, tok, epochs):
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [{"text": "the cat sat on the mat"}, "{bad", {"text": "a dog ran far away"}, {"x": 1}],
    )
    w = new_worker(f, tok, seq_len=4, mbs=1, on_bad_record="skip", epochs=epochs)
    batches = all_batches(w) if epochs else [w.next_batch() for _ in range(40)]
    assert max(b.epoch for b in batches) >= 1  # the bad records were read again, and skipped
    assert batches[-1].skipped_records == 2 and w.stats()["skipped_records"] == 2
    # a worker resumed in a later epoch carries the count on without adding to it
    later = next(b for b in batches if b.epoch == 1)
    resumed = new_worker(
        f, tok, seq_len=4, mbs=1, on_bad_record="skip", epochs=epochs, cursor=later.cursor
    )
    assert resumed.next_batch().skipped_records == 2


def test_worker_with_an_empty_shard(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, {"text": "c"}])
    w = new_worker(f, tok, w=3, n=4, epochs=None)
    with pytest.raises(DataError) as e:
        w.next_batch()
    assert str(e.value) == (
        f"worker 3 of 4 has no documents: {f} holds 3 document(s); "
        "use at most 3 tokenizer worker(s)"
    )


def test_shard_whose_records_are_all_bad(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", ["{x", '{"t": 1}'])
    w = new_worker(f, tok, on_bad_record="skip", epochs=None)
    with pytest.raises(DataError) as e:
        w.next_batch()
    assert str(e.value) == (
        f"worker 0 of 1: all 2 record(s) of its shard of {f} were bad and skipped "
        f'(last: {f}:2: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: "t")'
    )


def test_invalid_arguments_name_the_argument(data, tok):
    with pytest.raises(ValueError, match="on_bad_record must be one of"):
        new_worker(data[0], tok, on_bad_record="ignore")
    with pytest.raises(ValueError, match=r"worker_index 2 not in \[0, num_workers=2\)"):
        new_worker(data[0], tok, w=2, n=2)
    with pytest.raises(ValueError, match="eos_id 999 is outside the tokenizer's vocabulary"):
        TokenizeWorker(str(data[0]), tok[0], 0, 1, 8, 2, 999, 0)


def test_default_num_workers():
    assert default_num_workers(1) == 1
    assert default_num_workers(2) == 1
    assert default_num_workers(4) == 3
    assert default_num_workers(64) == 4
    assert default_num_workers(64, max_workers=16) == 16
    # never more workers than documents (each needs one): a single .txt file is one
    assert default_num_workers(64, documents=1) == 1
    assert default_num_workers(64, documents=3) == 3
    assert default_num_workers(3, documents=3) == 2
    assert default_num_workers(64, documents=0) == 1  # (an empty dataset is refused before)


# -- through Ray -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    import ray

    with ray_session(num_cpus=2, include_dashboard=False):
        yield ray


@pytest.mark.integration
def test_actors_tokenize_in_their_own_processes(ray_local, data, tok):
    ray = ray_local
    root, _ = data
    path, _, eos, pad = tok
    args = (str(root), path)
    actors = [
        ray.remote(TokenizeWorker).remote(*args, 0, 2, 8, 2, eos, pad),
        ray.remote(**ACTOR_OPTIONS)(TokenizeWorker).remote(*args, 1, 2, 8, 2, eos, pad),
    ]
    # ACTOR_OPTIONS' runtime env reaches the actor: tokenizers uses one thread, like its CPU.
    env = ray.get(actors[1].__ray_call__.remote(lambda self: os.environ.get("RAYON_NUM_THREADS")))
    assert env == "1"
    for w, actor in enumerate(actors):
        b = ray.get(actor.next_batch.remote())
        assert b.pid != os.getpid()
        assert b.pid == ray.get(actor.stats.remote())["pid"]
        want = new_worker(root, tok, w, 2, 8, 2, packing="documents").next_batch()
        assert_same_batches([b], [want])
        # A fresh actor resumes from the batch's cursor.
        resumed = ray.remote(TokenizeWorker).remote(*args, w, 2, 8, 2, eos, pad, cursor=b.cursor)
        assert_same_batches(
            ray.get([resumed.next_batch.remote() for _ in range(3)]),
            ray.get([actor.next_batch.remote() for _ in range(3)]),
        )
        ray.kill(resumed)
    for actor in actors:
        ray.kill(actor)


@pytest.mark.integration
def test_data_error_crosses_the_actor_boundary(ray_local, tmp_path, tok):
    ray = ray_local
    path, _, eos, pad = tok
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"prompt": "q"}])
    actor = ray.remote(TokenizeWorker).remote(str(f), path, 0, 1, 8, 2, eos, pad)
    message = f'{f}:2: record has no "text" (nor "prompt" + "completion", "messages", "conversations"); keys found: "prompt" ({SKIP_HINT})'
    with pytest.raises(DataError) as e:
        ray.get(actor.next_batch.remote())
    assert message in str(e.value)
    assert isinstance(e.value.cause, DataError) and str(e.value.cause) == message
    ray.kill(actor)


# -- documents longer than a row (--long-documents) ------------------------------------------


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_long_documents_are_split_truncated_or_dropped_and_resume_exactly(tmp_path, tok, packing):
    t = Tokenizer.from_file(tok[0])
    texts = sentences(12, seed=4)
    long_text = " ".join(texts[:8])  # more than two rows of 16
    docs = [{"text": texts[8]}, {"text": long_text}, {"text": texts[9]}, {"text": long_text}]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    lengths = [len(doc_stream(t, d, tok[2])[0]) for d in docs]
    S = 16
    assert lengths[1] > 2 * (S + 1) and max(lengths[0], lengths[2]) <= S + 1
    targets = {}
    for how in ("split", "truncate", "drop"):
        kw = dict(seq_len=S, mbs=2, packing=packing, long_documents=how)
        worker = new_worker(path, tok, **kw)
        batches = all_batches(worker)
        targets[how] = sum(b.n_tokens for b in batches)
        assert worker.long_total == 2  # both long documents seen, whatever was done with them
        kept = {"split": lengths[1], "truncate": S + 1, "drop": 0}[how]
        assert worker.long_tokens_left_out == 2 * (lengths[1] - kept)
        note = next(b.cut_note for b in batches if b.cut_note)
        assert note.startswith(f"{path}:2: a document of {lengths[1]:,} tokens is longer than")
        assert note.endswith(f"(--long-documents {how}; split | truncate | drop)")
        for k, b in enumerate(batches):  # a resumed worker goes on exactly
            rest = all_batches(new_worker(path, tok, **kw, cursor=b.cursor))
            assert_same_batches(rest, batches[k + 1 :])
    short = lengths[0] - 1 + lengths[2] - 1  # each short document: all but its first token
    if packing == "documents":  # rows hold whole pieces: every token but a piece's first trains
        assert targets["drop"] == short
        assert targets["truncate"] == short + 2 * S
        assert targets["split"] == short + 2 * (lengths[1] - 1)
    assert targets["drop"] < targets["truncate"] < targets["split"]
