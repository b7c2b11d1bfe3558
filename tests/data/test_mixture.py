"""Several datasets in one run (--mix-data PATH=WEIGHT): each epoch reads each dataset's quota
of documents, spread evenly, a weight under 1 moving on through the dataset from epoch to epoch;
a worker rebuilt at any batch's cursor reads on exactly as the uninterrupted one; --eval-split
holds documents out of every dataset, never trained, each validated once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from appliance.actors.tokenize_worker import TokenizeWorker
from appliance.adapter.evaluate import read_documents
from appliance.config import build_config
from appliance.data.listing import find_data_files
from appliance.data.mixture import MixedShardReader, Source, mix_order, quota
from appliance.data.records import Holdout, load_tokenizer, parse_document
from appliance.errors import ConfigError
from tests.helpers_tokenizer import WORDS, make_tokenizer


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def two(tmp_path):
    """Dataset A of 6 documents ("cat" words), B of 4 ("dog" words), each a distinct text."""
    a = write_jsonl(tmp_path / "a.jsonl", [" ".join(["cat"] * (i + 1)) for i in range(6)])
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "0.jsonl", ["dog", "dog dog"])
    write_jsonl(tmp_path / "b" / "1.jsonl", ["dog dog dog", "dog dog dog dog"])
    return a, tmp_path / "b"


def texts(reader):
    return [parse_document(raw).text for raw in reader]


def test_mix_order_spreads_each_quota_evenly():
    order = list(mix_order([6, 2]))
    assert order == [0, 0, 1, 0, 0, 0, 1, 0]  # B's two at 1/4 and 3/4 of the epoch
    assert sorted(list(mix_order([3, 5, 1]))) == [0] * 3 + [1] * 5 + [2]
    assert quota(0.5, 4) == 2 and quota(2, 4) == 8 and quota(0.01, 4) == 1


def test_each_epoch_reads_the_weighted_documents_and_a_half_moves_on(two):
    a, b = two
    sources = [Source(tuple(find_data_files(a)), 1.0), Source(tuple(find_data_files(b)), 0.5)]
    epoch0 = texts(MixedShardReader(sources, 0, 1, epoch=0))
    epoch1 = texts(MixedShardReader(sources, 0, 1, epoch=1))
    cats = [" ".join(["cat"] * (i + 1)) for i in range(6)]
    assert [t for t in epoch0 if "cat" in t] == cats == [t for t in epoch1 if "cat" in t]
    assert [t for t in epoch0 if "dog" in t] == ["dog", "dog dog"]
    assert [t for t in epoch1 if "dog" in t] == ["dog dog dog", "dog dog dog dog"]
    twice = [Source(sources[0].files, 1.0), Source(sources[1].files, 2.0)]
    dogs = [t for t in texts(MixedShardReader(twice, 0, 1)) if "dog" in t]
    assert dogs == ["dog", "dog dog", "dog dog dog", "dog dog dog dog"] * 2
    # two workers deal the mixed documents out between them, as one dataset's
    shards = [texts(MixedShardReader(sources, w, 2)) for w in (0, 1)]
    assert sorted(shards[0] + shards[1]) == sorted(epoch0)


def worker(a, b, tmp_path, w, n, cursor=None, **kw):
    tok, _, eos, pad = make_tokenizer(tmp_path / "tok")
    return TokenizeWorker(
        str(a), tok, w, n, seq_len=8, micro_batch_size=1, eos_id=eos, pad_id=pad, epochs=3,
        cursor=cursor, mix=[(str(b), 0.5, None)], **kw,
    )  # fmt: skip


def test_a_worker_rebuilt_at_any_cursor_reads_on_exactly(two, tmp_path):
    a, b = two
    for packing in ("documents", "stream"):
        for w in (0, 1):
            run = worker(a, b, tmp_path, w, 2, packing=packing)
            batches = []
            while (batch := run.next_batch()) is not None:
                batches.append(batch)
            assert len({batch.epoch for batch in batches}) == 3
            for k in range(0, len(batches) - 1, 2):
                again = worker(a, b, tmp_path, w, 2, cursor=batches[k].cursor, packing=packing)
                for later in batches[k + 1 :]:
                    got = again.next_batch()
                    np.testing.assert_array_equal(got.input_ids, later.input_ids)
                    np.testing.assert_array_equal(got.labels, later.labels)
                assert again.next_batch() is None


def test_held_out_documents_of_every_dataset_are_never_trained_and_validated_once(two, tmp_path):
    a, b = two
    holdout = Holdout(0.3, seed=1)
    sources = [Source(tuple(find_data_files(a)), 1.0), Source(tuple(find_data_files(b)), 2.0)]
    trained = set(texts(MixedShardReader(sources, 0, 1, holdout=holdout)))
    held = Holdout(0.3, seed=1, held_out=True)
    validated = texts(MixedShardReader(sources, 0, 1, holdout=held))
    everything = {parse_document(r).text for s in sources for r in MixedShardReader([s], 0, 1)}
    assert validated and trained and not trained & set(validated)
    assert trained | set(validated) == everything and len(set(validated)) == len(validated)
    # and evaluation reads the same set
    tok, _, eos, _ = make_tokenizer(tmp_path / "tok")
    docs = read_documents(a, load_tokenizer(tok), eos, 64, holdout=held, mix=[(b, 2.0, None)])
    assert len(docs) == len(validated)
    words = {i: w for w, i in load_tokenizer(tok).get_vocab().items() if w in WORDS}
    assert [" ".join(words[i] for i in ids[1:-1]) for ids, _ in docs] == validated


def test_mixture_flags_and_keys_are_checked_naming_them():
    cfg = build_config({"model": "m", "data": "d", "output": "o", "mix_data": {"b": 0.5, "c": 2}})
    assert cfg.mixture() == [("b", 0.5), ("c", 2.0)]
    with pytest.raises(ConfigError) as e:
        build_config(flag_values={"mix_data": "b,c=0,=1", "data_weight": "0"})
    assert str(e.value).splitlines()[:5] == [
        "--mix-data: b is not PATH=WEIGHT with a weight > 0 (e.g. chat.jsonl=0.5)",
        "--mix-data: c=0 is not PATH=WEIGHT with a weight > 0 (e.g. chat.jsonl=0.5)",
        "--mix-data: =1 is not PATH=WEIGHT with a weight > 0 (e.g. chat.jsonl=0.5)",
        "--mix-data needs --data (the first dataset of the mixture)",
        "--data-weight must be > 0 (got 0.0)",
    ]
