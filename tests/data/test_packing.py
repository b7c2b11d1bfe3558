"""Packing by documents: the row rules, exact resume, and the proof that a packed micro-batch's
loss and every LoRA gradient equal those of its documents run one by one through transformers +
PEFT (fp32, 1e-5), whatever they are packed with."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from appliance.actors.tokenize_worker import PACK_GROUP_ROWS, TokenizeWorker
from appliance.actors.trainer import _tensors
from appliance.data import packing
from appliance.data.packing import best_fit, fill_rows, split_document
from appliance.engine.blocks import DictBlockSource
from appliance.engine.step import StreamedEngine
from appliance.models.layers import IGNORE_INDEX
from tests.engine.test_engine_parity import assert_gradients_match, peft_reference
from tests.helpers_model import lora_with_random_b, make_model, rel_err
from tests.helpers_tokenizer import make_tokenizer, sentences

RTOL = 1e-5


def test_split_document_overlaps_by_one_and_drops_a_lone_last_token():
    ids, mask = np.arange(10), np.ones(10, dtype=bool)
    pieces = split_document(ids, mask, 4)
    assert [p.tolist() for p, _ in pieces] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    assert [p.tolist() for p, _ in split_document(np.arange(9), mask[:9], 4)] == [
        [0, 1, 2, 3, 4],
        [4, 5, 6, 7, 8],
    ]
    assert split_document(np.arange(1), mask[:1], 4) == []  # one token predicts nothing


def test_best_fit_never_overfills_and_places_the_longest_first():
    lengths = [5, 3, 8, 2, 2, 6, 1]
    rows = best_fit(lengths, 8)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    assert rows == [[2], [3, 5], [0, 1], [4, 6]]  # 8 | 6+2 | 5+3 | 2+1: 4 rows of 27 tokens
    assert len(best_fit([4] * 6, 8)) == 3


def test_fill_rows_positions_restart_and_no_target_crosses_a_document():
    pieces = [
        (np.array([10, 11, 12]), np.array([True, True, True])),
        (np.array([20, 21, 22, 23]), np.array([False, False, True, True])),
    ]
    ids, labels, pos, seg = fill_rows(pieces, 8, pad_id=0)
    assert ids.tolist() == [[10, 11, 20, 21, 22, 0, 0, 0]]
    assert labels.tolist() == [[11, 12, -100, 22, 23, -100, -100, -100]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0, 0, 0]]
    assert seg.tolist() == [[0, 0, 1, 1, 1, -1, -1, -1]]


def test_flex_block_mask_equals_the_dense_document_mask():
    """The mask_mod the CUDA path compiles selects exactly what the CPU path's bool mask does
    (checked here with flex_attention's eager reference, which runs on a CPU)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from appliance.models import layers

    g = torch.Generator().manual_seed(0)
    seg = torch.zeros(2, 160, dtype=torch.long)
    seg[0, 40:], seg[0, 130:], seg[1, 150:] = 1, 2, -1  # 3 documents | 1 document + padding
    q, k, v = (torch.randn(2, 2, 160, 8, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=layers.document_block_mask(seg))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=layers.document_mask(seg))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------- the worker


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_docs(path, n, seed=0, max_words=30):
    texts = sentences(n, seed=seed, max_words=max_words)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def worker(path, tok, **kw) -> TokenizeWorker:
    tok_path, _, eos, pad = tok
    args = dict(seq_len=12, micro_batch_size=3, eos_id=eos, pad_id=pad)
    return TokenizeWorker(str(path), tok_path, 0, 1, **{**args, **kw})


def drain(w: TokenizeWorker) -> list:
    out = []
    while (b := w.next_batch()) is not None:
        out.append(b)
    return out


def documents_of(batches) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of every document piece in `batches`, in row order."""
    out = []
    for b in batches:
        for r in range(b.input_ids.shape[0]):
            for s in sorted(set(b.segments[r].tolist()) - {-1}):
                at = b.segments[r] == s
                assert b.positions[r, at].tolist() == list(range(int(at.sum())))
                out.append((b.input_ids[r, at].tolist(), b.labels[r, at].tolist()))
    return out


def test_every_document_token_but_the_first_is_a_target_once_and_short_ones_stay_whole(
    tmp_path, tok
):
    texts = write_docs(tmp_path / "d.jsonl", 150, max_words=30)  # some longer than a row
    t = Tokenizer.from_file(tok[0])
    batches = drain(worker(tmp_path / "d.jsonl", tok))
    got = documents_of(batches)
    # every document is its ids with EOS, inputs ids[:-1] and targets ids[1:] (so its first
    # token is never a target); short ones are one piece, long ones seq_len pieces
    want = []
    for text in texts:
        ids = t.encode(text).ids + [tok[2]]
        for p, _ in split_document(np.array(ids), np.ones(len(ids), dtype=bool), 12):
            want.append((p[:-1].tolist(), p[1:].tolist()))
    assert sorted(got) == sorted(want)
    assert all((b.labels[b.segments == -1] == IGNORE_INDEX).all() for b in batches)
    row_tokens = sum(b.input_ids.size for b in batches)
    efficiency = sum(b.n_tokens for b in batches) / row_tokens
    assert efficiency > 0.85  # best fit leaves little padding (stream packing would: ~1.0)


def test_resume_from_every_cursor_reproduces_the_rest(tmp_path, tok):
    write_docs(tmp_path / "d.jsonl", 120, seed=3)
    kw = dict(seq_len=8, micro_batch_size=2, epochs=2)
    full = drain(worker(tmp_path / "d.jsonl", tok, **kw))
    assert len(full) > PACK_GROUP_ROWS  # several groups, two epochs
    for i in range(0, len(full) - 1, 7):
        rest = drain(worker(tmp_path / "d.jsonl", tok, cursor=full[i].cursor, **kw))
        assert len(rest) == len(full) - i - 1
        for a, b in zip(rest, full[i + 1 :], strict=True):
            for name in ("input_ids", "labels", "positions", "segments"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert a.cursor == b.cursor


def test_stream_cursor_is_refused_by_a_documents_worker(tmp_path, tok):
    write_docs(tmp_path / "d.jsonl", 20)
    b = worker(tmp_path / "d.jsonl", tok, packing="stream").next_batch()
    from appliance.data.records import DataError

    with pytest.raises(DataError, match="--packing stream"):
        worker(tmp_path / "d.jsonl", tok, cursor=b.cursor)


# -------------------------------------------------------------------------- the proof


def doc_loss_sum(model, ids: list[int], labels: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([ids])).logits.float()[0]
    return F.cross_entropy(logits, torch.tensor(labels), ignore_index=-100, reduction="sum")


def test_packed_batch_equals_its_documents_one_by_one_through_transformers_and_peft(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    tok = (str(model_dir / "tokenizer.json"), 1, 2, 0)
    texts = sentences(24, seed=5, max_words=6)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": t, "completion": "red cat"} if i % 3 else {"text": t}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    batches = drain(worker(data, tok, seq_len=16, micro_batch_size=2))  # ~4 micro-batches
    assert (
        max(len(set(b.segments[r].tolist()) - {-1}) for b in batches for r in range(2)) >= 3
    )  # real packing
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    lora = lora_with_random_b(source.args)
    ref = peft_reference(model_dir, lora, tmp_path)

    engine = StreamedEngine(source, lora, grad_clip=None)
    loss, n_target, _ = engine.forward_backward(_tensors(batches), step=0)

    docs = documents_of(batches)
    assert n_target == sum(sum(x != -100 for x in lab) for _, lab in docs)
    ref_loss = sum(doc_loss_sum(ref, ids, lab) for ids, lab in docs) / n_target
    ref_loss.backward()
    assert rel_err(torch.tensor(loss), ref_loss) < RTOL
    assert_gradients_match(lora, ref)

    # a document's loss does not depend on what it is packed with: the first document of a
    # shared row scores the same in its row as alone
    b = next(b for b in batches if len(set(b.segments[0].tolist()) - {-1}) >= 2)

    def row0(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a[:1]))

    labels = row0(b.labels).clone()
    labels[row0(b.segments) != 0] = -100
    layout = (row0(b.positions), row0(b.segments))
    in_company, _ = engine.eval_loss([(row0(b.input_ids), labels, layout)])
    at = b.segments[0] == 0
    alone, _ = engine.eval_loss(
        [(torch.tensor([b.input_ids[0, at].tolist()]), torch.tensor([b.labels[0, at].tolist()]))]
    )
    assert abs(in_company - alone) / alone < RTOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_on_cuda_equals_the_masked_sdpa_on_cpu(tmp_path, tok):
    """The CUDA path (flex_attention with a document BlockMask, compiled) gives the CPU path's
    loss and LoRA gradients (fp32, TF32 off), on rows longer than flex's 128-token blocks."""
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied", max_position_embeddings=512)
    data = tmp_path / "d.jsonl"
    write_docs(data, 300, seed=9, max_words=60)
    batches = drain(worker(data, tok, seq_len=256, micro_batch_size=2))[:2]
    source = DictBlockSource.from_hf(model_dir, torch.float32)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        results = []
        for device in ("cpu", "cuda"):
            lora = lora_with_random_b(source.args, device=device)
            engine = StreamedEngine(source, lora, device=device, grad_clip=None)
            loss, _, _ = engine.forward_backward(_tensors(batches), step=0)
            results.append((loss, [p.grad.cpu() for p in lora.parameters()]))
            engine.close()
    finally:
        torch.set_float32_matmul_precision(precision)
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(gpu_loss - cpu_loss) / cpu_loss < RTOL
    for g, c in zip(gpu_grads, cpu_grads, strict=True):
        assert rel_err(g, c) < RTOL


def test_the_rows_ignore_index_is_the_one_the_loss_skips():
    """data.packing writes its own IGNORE_INDEX (the tokenizer workers import no torch): it is
    the model loss's, which is PyTorch's cross_entropy default."""
    assert packing.IGNORE_INDEX == IGNORE_INDEX
    logits, labels = torch.randn(3, 5), torch.tensor([1, packing.IGNORE_INDEX, 2])
    assert F.cross_entropy(logits, labels) == F.cross_entropy(logits[[0, 2]], labels[[0, 2]])
