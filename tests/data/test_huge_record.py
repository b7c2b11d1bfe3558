"""Memory while reading and tokenizing data is bounded whatever one record's size, and what is
cut is said once (issue 44, item 6): one 256 MB JSONL line drove the driver to 23 GB RSS and an
OOM kill (a 16 MB line: 1.8 GB)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from appliance.data.files import MAX_LINE_BYTES, count_documents
from appliance.data.records import MAX_RECORD_CHARS, ShardReader, parse_document
from tests.helpers_cli import train_in_process
from tests.helpers_model import make_model
from tests.helpers_tokenizer import make_tokenizer, sentences

WORDS = "the cat sat on a mat and the dog ran far away "


def huge_jsonl(path, text_chars: int, line_bytes: int) -> None:
    """Three records: a normal one, one whose text is `text_chars` long (a line under the line
    limit), one whose line is `line_bytes` long (over it), then a normal one."""
    big_text = (WORDS * (text_chars // len(WORDS) + 1))[:text_chars]
    huge_line = json.dumps({"text": "x" * line_bytes})
    with open(path, "w") as f:
        f.write(json.dumps({"text": "a first record"}) + "\n")
        f.write(json.dumps({"text": big_text}) + "\n")
        f.write(huge_line + "\n")
        f.write(json.dumps({"text": "a last record"}) + "\n")


def test_a_long_text_is_cut_and_a_line_too_long_is_left_out_each_saying_so(tmp_path):
    data = tmp_path / "data.jsonl"
    huge_jsonl(data, MAX_RECORD_CHARS + 5000, MAX_LINE_BYTES + 10)
    assert count_documents([data], 100) == 4  # the long line is still a document, counted
    records = [parse_document(raw) for raw in ShardReader([data], 0, 1)]
    assert [r.text for r in records][::3] == ["a first record", "a last record"]
    assert len(records[1].text) == MAX_RECORD_CHARS and records[1].cut
    assert f"{data}:2: text cut to {MAX_RECORD_CHARS:,} of its" in records[1].cut
    assert records[2].text == "" and f"{data}:3: a line of" in records[2].cut
    assert "is left out" in records[2].cut and "split long documents" in records[2].cut
    assert records[0].cut is None and records[3].cut is None


READ_AND_ENCODE = """
import resource, sys
from appliance.data.records import ShardReader, encode_records, load_tokenizer, parse_document
tok = load_tokenizer(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from pathlib import Path
records = [parse_document(raw) for raw in ShardReader([Path(sys.argv[1])], 0, 1)]
encoded = encode_records(tok, records, 2)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_reading_and_tokenizing_a_huge_line_takes_bounded_memory(tmp_path):
    """A 12 MB text and a 40 MB line: read, parse and tokenize them in a fresh process; the
    growth of its peak memory stays within a few hundred MB (before: the 12 MB text alone took
    over 1 GB to tokenize, and the 40 MB line several more)."""
    data = tmp_path / "data.jsonl"
    huge_jsonl(data, 12 << 20, 40 << 20)
    tokenizer = make_tokenizer(tmp_path / "tok")[0]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READ_AND_ENCODE), str(data), str(tokenizer)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    grew = int(out.stdout.split()[-1])
    assert grew < 600 << 20, f"peak memory grew {grew / 2**20:.0f} MiB"


@pytest.mark.integration
def test_a_run_over_huge_records_trains_and_says_what_was_cut_once(ray_local, tmp_path, caplog):
    """In this process, on the shared Ray: what the run says is what it is about."""
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "data.jsonl"
    huge_jsonl(data, MAX_RECORD_CHARS + 10, MAX_LINE_BYTES + 10)
    with open(data, "a") as f:
        f.write(json.dumps({"text": "x" * (MAX_LINE_BYTES + 5)}) + "\n")  # another: not named
        f.writelines(json.dumps({"text": s}) + "\n" for s in sentences(30))
    with caplog.at_level(logging.WARNING):  # a warning logged goes to stderr in a child
        done = train_in_process("--model", model, "--data", data, "--output", tmp_path / "o",
                                "--steps", "3", "--seq-len", "16", "--micro-batch-size", "2",
                                "--tokenize-workers", "1")  # fmt: skip
    text = done.stdout + done.stderr + caplog.text
    assert done.returncode == 0, text[-3000:]
    said = [line for line in text.splitlines() if "split long documents" in line]
    assert len(said) == 1, text[-3000:]
    assert said[0].startswith(f"warning: {data}:") and "said once" in said[0]
