"""Quantized base weights: the codes equal the definitions; the flat layout and the store's bytes.

The reference implementations below are written value by value from the definitions in the
issue (and reference.py's docstring), in numpy, independently of the vectorised torch code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance import quant
from appliance.actors.weight_store import WeightStore, local_source, store_nbytes
from appliance.engine.blocks import pack, quantized_view, unpack
from appliance.errors import ModelError
from appliance.models import param_count
from appliance.models.layers import ModelArgs
from appliance.quant import NF4_LEVELS, QuantizedTensor, reference
from tests.helpers_model import make_model

LEVELS = np.array(NF4_LEVELS, dtype=np.float32)


def reference_int8(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """scale = max|w_row| / 127 (fp32); q = clamp(round(w / scale), -127, 127); zero row: 0."""
    x = w.float().numpy()
    codes = np.zeros(x.shape, np.int8)
    scales = np.zeros(x.shape[0], np.float32)
    for r, row in enumerate(x):
        scale = np.float32(np.abs(row).max()) / np.float32(127)
        scales[r] = scale
        if scale == 0:
            continue
        for c, v in enumerate(row):
            codes[r, c] = int(np.clip(np.round(np.float32(v) / scale), -127, 127))  # half-even
    return codes, scales


def reference_nf4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of 64 (zero-padded), absmax per block, nearest level (first on ties), 2 per byte
    with the first value in the high nibble."""
    x = w.float().numpy().reshape(-1)
    x = np.concatenate([x, np.zeros(-len(x) % 64, np.float32)])
    codes, absmax = [], []
    for block in x.reshape(-1, 64):
        m = np.float32(np.abs(block).max())
        absmax.append(m)
        for v in block:
            y = np.float32(v) / m if m != 0 else np.float32(0.0)
            codes.append(int(np.argmin(np.abs(y - LEVELS))))
    packed = [(codes[k] << 4) | codes[k + 1] for k in range(0, len(codes), 2)]
    return np.array(packed, np.uint8), np.array(absmax, np.float32)


def int8_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 70, generator=g)
    w[3] = 0  # a zero row
    w[5, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1: exact halves
    w[5, 6:] = 0.25
    big = torch.randn(70, 130, generator=g).to(torch.bfloat16)  # 9100 values: several chunks
    # long rows (the C kernel widens a whole row into its scratch buffer, then codes it), not a
    # multiple of 64; row 1's absmax near its end, row 2 all zeros
    wide = torch.randn(3, 9000, generator=g)
    wide[1, 8500] = 40.0
    wide[2] = 0
    return [
        w,
        w.to(torch.bfloat16),
        torch.randn(1, 1, generator=g),
        w.to(torch.float16),
        big,
        wide.to(torch.bfloat16),
    ]


def nf4_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    padded = torch.randn(5, 37, generator=g)  # 185 values: 3 blocks, the last one padded
    zero_block = torch.randn(3, 64, generator=g)
    zero_block[1] = 0  # block 1 is all zeros
    mids = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)  # fp32 midpoints: distance ties
    ties = torch.zeros(2, 32)
    ties.view(-1)[0] = 1.0  # absmax 1: w / absmax is w itself
    ties.view(-1)[1:16] = torch.from_numpy(mids)
    ties.view(-1)[16:31] = -torch.from_numpy(mids)
    big = torch.randn(70, 130, generator=g).to(torch.bfloat16)  # 9100 values: several chunks
    big[7] = 0
    # the code's edges: each level's threshold (the smallest fp32 nearer the level above, as the
    # definition's fp32 distances decide) and the fp32 just below it, with absmax 1
    t = reference.NF4_THRESHOLDS
    edges = torch.zeros(64)
    edges[0] = 1.0
    edges[1:16] = t
    edges[16:31] = torch.nextafter(t, torch.tensor(-math.inf))
    return [
        padded,
        zero_block,
        ties,
        padded.to(torch.bfloat16),
        torch.randn(1, 3, generator=g),
        padded.to(torch.float16),
        big,
        edges.view(2, 32),
    ]


def fused():
    """quant_cpu, the fused C kernels: quant.quantize's path on a CPU. Built by every install
    with a C compiler (as `make test`'s): a missing build fails here rather than skipping."""
    from appliance.quant import cpu as quant_cpu

    assert reference._fused_kernels() is quant_cpu
    return quant_cpu


# the two implementations of each definition: the fused CPU kernel and the PyTorch functions
# (what an install without the C extension, or a CUDA tensor, uses); each must equal the
# reference exactly
INT8 = {"fused": lambda w: fused().quantize_int8(w), "torch": reference.quantize_int8}
NF4_PATHS = ["x86-64-v4", "x86-64-v3", "count"]  # the C kernel's ways to find the codes


def fused_nf4(w: torch.Tensor, path: str | None = None, thresholds=reference.NF4_THRESHOLDS):
    """The fused NF4 kernel, by its default path or by one named (skipped on a CPU without it:
    CI's and this machine's run all three)."""
    if path is not None and path not in fused().paths():
        pytest.skip(f"this CPU does not run the {path} path ({fused().paths()})")
    return fused().quantize_nf4(w, thresholds, path=path)


NF4 = {
    "fused": fused_nf4,
    **{f"fused-{p}": lambda w, p=p: fused_nf4(w, p) for p in NF4_PATHS},
    "torch": reference.quantize_nf4,
}


@pytest.mark.parametrize("impl", INT8)
@pytest.mark.parametrize("case", range(6))
def test_int8_codes_and_scales_equal_the_definition(case, impl):
    w = int8_cases()[case]
    got = INT8[impl](w)
    assert got[2] == -1  # no row refused
    q = QuantizedTensor("int8", tuple(w.shape), got[0], got[1])
    codes, scales = reference_int8(w)
    assert q.codes.dtype == torch.int8 and q.codes.shape == w.shape
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.scales.numpy(), scales)
    back = quant.dequantize(q, torch.float32)
    np.testing.assert_array_equal(back.numpy(), codes.astype(np.float32) * scales[:, None])
    if case == 0:
        assert not back[3].any()  # the zero row stays zero
        assert q.codes[5, :6].tolist() == [127, 0, 2, 2, 0, -2]  # round half to even


@pytest.mark.parametrize("impl", NF4)
@pytest.mark.parametrize("case", range(8))
def test_nf4_codes_and_absmax_equal_the_definition(case, impl):
    w = nf4_cases()[case]
    got = NF4[impl](w)
    assert got[2] == -1  # no block refused
    q = QuantizedTensor("nf4", tuple(w.shape), got[0], got[1])
    codes, absmax = reference_nf4(w)
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.scales.numpy(), absmax)
    back = quant.dequantize(q, torch.float32)
    values = np.stack([codes >> 4, codes & 15], axis=1).reshape(-1, 64)
    expect = (LEVELS[values] * absmax[:, None]).reshape(-1)[: w.numel()].reshape(w.shape)
    np.testing.assert_array_equal(back.numpy(), expect)
    if case == 1:
        assert (q.codes[32:64] == 0x77).all() and q.scales[1] == 0  # a zero block codes 0.0
    if case == 0:
        assert (q.codes[-4:] & 15 == 7).all()  # the padding codes 0.0


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("impl", ["fused", "torch"])
def test_inf_or_nan_weights_are_refused_naming_the_tensor_and_where(kind, impl, monkeypatch):
    """A damaged checkpoint (an inf or a NaN in a weight) is refused before it is coded: its
    absmax would make every code of the row or block meaningless."""
    if impl == "torch":
        monkeypatch.setattr(reference, "_fused_kernels", lambda: None)
    w = torch.randn(6, 100, dtype=torch.bfloat16)
    w[4, 70] = float("nan")
    w[5, 3] = float("inf")
    with pytest.raises(ModelError) as e:
        quant.quantize(w, kind, "model.layers.1.self_attn.o_proj.weight")
    where = "row 4" if kind == "int8" else "values 448..511"  # value 470 is in block 7
    assert "model.layers.1.self_attn.o_proj.weight" in str(e.value) and where in str(e.value)
    assert "--base-quant none" in str(e.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_kernels_equal_the_pytorch_functions_on_real_sized_weights(dtype):
    """Bit for bit, on a weight of a real model's width (the 1B shape's k_proj: 512 x 2048, and
    an MLP row of 8192) with values spread over many binades, tiny and large: the C kernels'
    vectorized loops, chunk edges and tails against reference.py's PyTorch functions (which the
    tests above hold to the definition value by value)."""
    g = torch.Generator().manual_seed(7)
    for shape in [(512, 2048), (24, 8192 + 64 * 3)]:
        w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 8, shape, generator=g))
        w = w.to(dtype)
        nf4 = reference.quantize_nf4(w)
        for kind, ours, theirs in [
            ("int8", fused().quantize_int8(w), reference.quantize_int8(w)),
            *((f"nf4 {p}", fused_nf4(w, p), nf4) for p in fused().paths()),
        ]:
            assert ours[2] == -1 and theirs[2] == -1, kind
            assert torch.equal(ours[0], theirs[0]), (kind, shape)
            assert torch.equal(ours[1], theirs[1]), (kind, shape)


def test_the_c_kernels_refuse_buffers_of_the_wrong_size():
    """The extension's own checks: a buffer shorter than the kernel would write or read is a
    ValueError naming it, never a write past its end."""
    from appliance.quant import _quantize

    src = np.zeros(128, np.uint16)
    thresholds = reference.NF4_THRESHOLDS.numpy()
    with pytest.raises(ValueError, match="codes"):
        _quantize.nf4(src, 2, thresholds, np.zeros(63, np.uint8), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="absmax"):
        _quantize.nf4(src, 2, thresholds, np.zeros(64, np.uint8), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="64-value blocks"):
        _quantize.nf4(src[:100], 2, thresholds, np.zeros(64, np.uint8), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="itemsize 3"):
        _quantize.nf4(src, 3, thresholds, np.zeros(64, np.uint8), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="src"):
        _quantize.int8(src, 2, 4, 64, np.zeros(256, np.int8), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="scales"):
        _quantize.int8(src, 2, 2, 64, np.zeros(128, np.int8), np.zeros(1, np.float32))
    with pytest.raises(TypeError):  # codes must be writable
        _quantize.int8(src, 2, 2, 64, bytes(128), np.zeros(2, np.float32))
    assert _quantize.nf4(src, 2, thresholds, np.zeros(64, np.uint8), np.zeros(2, np.float32)) == -1
    with pytest.raises(ValueError, match="path sse9: not one this CPU runs"):
        _quantize.nf4(src, 2, thresholds, np.zeros(64, np.uint8), np.zeros(2, np.float32), "sse9")


@pytest.mark.parametrize("path", NF4_PATHS)
def test_thresholds_the_bins_cannot_separate_are_counted(path):
    """The table paths need at most one threshold per 1/16-wide bin (NF4's are >= 0.08 apart);
    given two in one bin, every path counts instead, and the codes are still the count of
    thresholds <= w / absmax."""
    g = torch.Generator().manual_seed(3)
    t = torch.sort(torch.rand(15, generator=g) * 2 - 1).values
    t[1] = t[0] + 0.01  # same bin
    t = torch.sort(t).values.contiguous()
    w = torch.rand(4, 64, generator=g) * 2 - 1
    w[:, 0] = 1.0  # absmax 1: w / absmax is w
    w[1, 1:16] = t  # exactly on each threshold
    codes, _, bad = fused_nf4(w, path, t)
    assert bad == -1
    want = (t[None, :] <= w.reshape(-1)[:, None]).sum(1)
    got = torch.stack([codes >> 4, codes & 15], 1).reshape(-1)
    assert torch.equal(got.long(), want)


def test_without_the_c_extension_quantize_warns_and_codes_the_same(monkeypatch):
    """An install without a C compiler (or a source tree never installed, as on a bare GPU
    image): appliance.quant._quantize does not import; quantize says so once, naming the fix, and
    codes with the PyTorch functions, the same values."""
    import sys

    import appliance.quant

    fused()  # imported once, as in any process that quantized before
    w = nf4_cases()[0]
    want = quant.quantize(w, "nf4")
    monkeypatch.setitem(sys.modules, "appliance.quant._quantize", None)  # its import now fails
    monkeypatch.delitem(sys.modules, "appliance.quant.cpu")
    for name in ("_quantize", "cpu"):  # else the import finds the package's attribute
        monkeypatch.delattr(appliance.quant, name)
    reference._fused_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not built.*C compiler"):
            got = quant.quantize(w, "nf4")
        assert reference._fused_kernels() is None
    finally:
        reference._fused_kernels.cache_clear()
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("case", [0, 1, 3, 4])
def test_bitsandbytes_nf4_agrees_where_it_installs(case):
    """bitsandbytes' `quantize_4bit(nf4, blocksize=64)`: the same absmax and codes (it stores
    only the values' codes, no padding); installed as a test extra (its CPU kernels).

    Not on case 2, the values placed exactly on the fp32 midpoints between two levels: there
    bitsandbytes compares with its midpoint thresholds (a midpoint goes to the lower level), the
    definition measures the two fp32 distances, which rounding makes unequal (5 of 30 differ)."""
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed")
    w = nf4_cases()[case].float().contiguous()
    try:
        packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    except Exception as e:  # noqa: BLE001 - a build without the 4-bit kernels for this device
        pytest.skip(f"bitsandbytes quantize_4bit does not run here: {e}")
    q = quant.quantize(w, "nf4")
    theirs = packed.reshape(-1).numpy()
    np.testing.assert_array_equal(theirs, q.codes[: theirs.size].numpy())
    np.testing.assert_array_equal(state.absmax.numpy(), q.scales.numpy())


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("fused_kernels", [True, False])
def test_quantize_into_a_buffer_writes_the_codes_in_place(kind, fused_kernels, monkeypatch):
    """How the store quantizes: the codes and scales go straight into the block's buffer, at
    the entry's offset, equal to quantize's own (fused kernels, or the PyTorch functions)."""
    w = (int8_cases() if kind == "int8" else nf4_cases())[0]
    want = quant.quantize(w, kind)
    if not fused_kernels:
        monkeypatch.setattr(reference, "_fused_kernels", lambda: None)
    size = quant.quantized_nbytes(tuple(w.shape), kind)
    flat = torch.full((64 + size + 64,), 0xAB, dtype=torch.uint8)  # a neighbour on each side
    out = quantized_view(flat, 64, tuple(w.shape), kind)
    assert quant.quantize(w, kind, out=out) is out
    assert torch.equal(out.codes, want.codes) and torch.equal(out.scales, want.scales)
    code_bytes, scales_at, n = quant.entry_layout(tuple(w.shape), kind)
    assert (flat[:64] == 0xAB).all() and (flat[64 + scales_at + 4 * n :] == 0xAB).all()
    assert torch.equal(flat[64 : 64 + code_bytes].view(want.codes.dtype), want.codes.reshape(-1))


def test_quantized_weights_round_trip_through_a_flat_buffer():
    w8, w4 = int8_cases()[0], nf4_cases()[0]
    tensors = {
        "input_layernorm.weight": torch.randn(7),
        "self_attn.q_proj.weight": quant.quantize(w8, "int8"),
        "mlp.up_proj.weight": quant.quantize(w4, "nf4"),
    }
    buf, index = pack(tensors)
    assert index["mlp.up_proj.weight"][1:] == ((5, 37), "nf4")
    assert buf.nbytes == sum(
        quant.quantized_nbytes(tuple(t.shape), getattr(t, "kind", "none"), torch.float32)
        for t in tensors.values()
    )
    back = unpack(buf, index)
    assert torch.equal(back["input_layernorm.weight"], tensors["input_layernorm.weight"])
    for name in ("self_attn.q_proj.weight", "mlp.up_proj.weight"):
        a, b = back[name], tensors[name]
        assert isinstance(a, QuantizedTensor) and a.shape == b.shape and a.kind == b.kind
        assert torch.equal(quant.dequantize(a, torch.float32), quant.dequantize(b, torch.float32))


def test_only_linear_projection_weights_are_quantized():
    linear = ["self_attn.q_proj.weight", "mlp.down_proj.weight", "self_attn.qkv_proj.weight"]
    linear.append("mlp.gate_up_proj.weight")  # fused modules (Phi-3) too
    other = ["self_attn.q_proj.bias", "input_layernorm.weight", "self_attn.q_norm.weight"]
    other += ["model.embed_tokens.weight", "lm_head.weight"]
    assert all(quant.is_linear_weight(n) for n in linear)
    assert not any(quant.is_linear_weight(n) for n in other)


@pytest.mark.parametrize(
    ("shape", "dtype", "needle"),
    [
        ((4, 8), torch.int8, "dtype torch.int8 is not floating point"),
        ((32,), torch.float32, "shape (32,) cannot be quantized"),
        ((0, 8), torch.float32, "shape (0, 8) cannot be quantized"),
    ],
)
def test_weights_that_cannot_be_coded_are_refused_naming_the_tensor(shape, dtype, needle):
    with pytest.raises(ModelError, match="^model.layers.2.mlp.up_proj.weight: ") as e:
        quant.quantize(torch.zeros(shape, dtype=dtype), "nf4", "model.layers.2.mlp.up_proj.weight")
    assert needle in str(e.value)


def test_the_store_refuses_an_integer_linear_weight_before_reading_any_block(tmp_path):
    model_dir = make_model(tmp_path / "model", "llama-mha")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, path, metadata={"format": "pt"})
    assert len(local_source(model_dir, "float32").block(1)) == 9  # unquantized: converted
    with pytest.raises(ModelError, match=f"^{name}: dtype I8 is not floating point"):
        WeightStore(model_dir, "float32", "int8").handles()


@pytest.mark.parametrize("kind", ["none", "int8", "nf4"])
def test_store_bytes_equal_the_shape_formula_and_what_the_device_is_sent(tmp_path, kind):
    model_dir = make_model(tmp_path / "model", "llama-gqa-rope3-tied")
    store = WeightStore(model_dir, "bfloat16", kind)
    handles = store.handles()
    assert handles.base_quant == kind
    assert handles.nbytes == store_nbytes(handles.args, "bfloat16", kind)
    source = handles.source()
    linear = [v for k, v in source.block(0).items() if quant.is_linear_weight(k)]
    assert len(linear) == 7
    assert all(isinstance(v, QuantizedTensor) == (kind != "none") for v in linear)


def llama_shape(vocab, hidden, inter, layers, heads, kv, tied) -> ModelArgs:
    return ModelArgs(
        "LlamaForCausalLM", vocab, hidden, inter, layers, heads, kv, hidden // heads, 1e-5,
        500000.0, 131072, tie_word_embeddings=tied,
    )  # fmt: skip


def test_store_bytes_of_the_1b_and_70b_shapes():
    """From the shapes (materialising 1B parameters would take a minute here). The embeddings
    stay in bf16 (the definition), so the whole-model ratios for the 1B shape (whose tied
    embedding is a fifth of its bytes) are 0.61 and 0.43: the issue's 0.53 / 0.30 hold for the
    blocks, and for the whole 70B shape within 1%."""
    one_b = llama_shape(128256, 2048, 8192, 16, 32, 8, tied=True)
    bf16 = store_nbytes(one_b, "bfloat16")
    assert bf16 == pytest.approx(param_count(one_b) * 2, rel=1e-4)
    embed = math.prod((128256, 2048)) * 2 + 2048 * 2  # embeddings + final norm, in bf16
    ratios = {k: store_nbytes(one_b, "bfloat16", k) / bf16 for k in ("int8", "nf4")}
    blocks = {k: (store_nbytes(one_b, "bfloat16", k) - embed) / (bf16 - embed) for k in ratios}
    assert blocks["int8"] <= 0.53 and blocks["nf4"] <= 0.30
    assert 0.60 < ratios["int8"] < 0.61 and 0.43 < ratios["nf4"] < 0.44
    big = llama_shape(128256, 8192, 28672, 80, 64, 8, tied=False)
    bf16 = store_nbytes(big, "bfloat16")
    assert store_nbytes(big, "bfloat16", "int8") / bf16 <= 0.53
    assert store_nbytes(big, "bfloat16", "nf4") / bf16 <= 0.303
