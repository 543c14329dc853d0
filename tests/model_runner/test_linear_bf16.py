"""bf16 GEMMs on CPUs that only emulate bf16: prefill-sized ones run in fp32 and round once.  On
CPUs with native bf16 the large weights' packed copies stay bf16 and take every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runner.layers import linear as linear_mod


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", True)


def operands(rows: int):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=g).bfloat16()
    w = (torch.randn(200, 384, generator=g) * 0.05).bfloat16()
    return x, w


def test_many_rows_are_one_fp32_gemm_rounded_once(emulated):
    x, w = operands(linear_mod.UPCAST_MIN_ROWS)
    out = linear_mod.linear(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float()).bfloat16())
    # Against the bf16 GEMM itself only the fp32 summation order differs: at most one bf16
    # rounding step (2^-8 relative) apart, plus fp32 reordering error where terms cancel.
    native = F.linear(x, w).float()
    bound = native.abs() * 2.0**-7 + 1e-5 * (x.float().abs() @ w.float().abs().T)
    assert ((out.float() - native).abs() <= bound).all()


def test_few_rows_keep_the_bf16_gemm(emulated):
    x, w = operands(linear_mod.UPCAST_MIN_ROWS - 1)
    assert torch.equal(linear_mod.linear(x, w), F.linear(x, w))
    x3 = x.view(1, *x.shape)  # rows are counted over every leading dim
    assert torch.equal(linear_mod.linear(x3, w), F.linear(x3, w))


def test_a_transposed_weight_is_upcast_at_any_row_count(emulated):
    x, w = operands(1)
    w_t = w.t().contiguous().t()  # the same [out, in] values over [in, out] storage
    assert torch.equal(linear_mod.linear(x, w_t), F.linear(x.float(), w.float()).bfloat16())


def test_native_bf16_cpus_and_fp32_are_untouched(monkeypatch):
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", False)
    x, w = operands(64)
    assert torch.equal(linear_mod.linear(x, w), F.linear(x, w))
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", True)
    assert torch.equal(linear_mod.linear(x.float(), w.float()), F.linear(x.float(), w.float()))


needs_onednn = pytest.mark.skipif(not linear_mod._HAS_ONEDNN, reason="torch built without oneDNN")


def big_weight(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(1024, linear_mod.PACK_MIN_ELEMENTS // 1024, generator=g) * 0.03).to(dtype)


@needs_onednn
def test_packed_gemm_matches_torch_and_one_row_keeps_torch():
    w = big_weight()
    packed = linear_mod.pack_weight(w)
    assert packed is not None
    x = torch.randn(17, w.shape[1], generator=torch.Generator().manual_seed(1))
    out = linear_mod.linear(x, w, packed)
    # fp32, K = 512 terms of |x w| ~ 0.03: only the summation order differs from torch's GEMM
    ref = F.linear(x.double(), w.double())
    assert (out.double() - ref).abs().max() <= 1e-5 * (x.abs() @ w.abs().T).max()
    one = x[:1]
    assert torch.equal(linear_mod.linear(one, w, packed), F.linear(one, w))
    many = torch.randn(linear_mod.PACK_MAX_ROWS + 1, w.shape[1])  # a large chunk: torch's GEMM
    assert torch.equal(linear_mod.linear(many, w, packed), F.linear(many, w))
    x3 = x.view(1, 17, -1)  # leading dims are flattened and restored
    assert torch.equal(linear_mod.linear(x3, w, packed), out.view(1, 17, -1))


@needs_onednn
def test_packed_gemm_rounds_bf16_once():
    w = big_weight(torch.bfloat16)
    packed = linear_mod.pack_weight(w)
    x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    out = linear_mod.linear(x, w, packed)
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.double(), w.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-5).all()


def test_small_and_non_cpu_weights_are_not_packed():
    assert linear_mod.pack_weight(torch.zeros(64, 64)) is None
    assert linear_mod.pack_weight(torch.zeros(3, 4, 5)) is None


def test_emulated_bf16_decode_attention_rounds_like_bf16(emulated, monkeypatch):
    from model_runner.layers.attention import causal_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 64, generator=g).bfloat16()
    k, v = (torch.randn(300, 2, 64, generator=g).bfloat16() for _ in range(2))
    fast = causal_attention(q, k, v, 299, 0.125)
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", False)
    native = causal_attention(q, k, v, 299, 0.125)
    assert fast.dtype == torch.bfloat16
    # the same roundings, fp32 products in another summation order: a bf16 step apart at most
    assert ((fast.float() - native.float()).abs() <= native.float().abs() * 2.0**-7 + 1e-3).all()


@needs_onednn
def test_one_row_of_a_transposed_weight_takes_the_packed_gemm(emulated):
    w_t = big_weight(torch.bfloat16).t().contiguous().t()  # an expert's [out, in] view
    packed = linear_mod.pack_weight(w_t)
    x = torch.randn(1, w_t.shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    out = linear_mod.linear(x, w_t, packed)
    assert torch.equal(out, linear_mod.packed_linear(x, packed))
    w = w_t.contiguous()  # a contiguous bf16 weight keeps the bf16 GEMV at one row
    assert torch.equal(linear_mod.linear(x, w, linear_mod.pack_weight(w)), F.linear(x, w))
    w32 = w_t.float()  # fp32 too; the packed layout is accurate at one row
    out = linear_mod.linear(x.float(), w32, linear_mod.pack_weight(w32))
    assert torch.allclose(out, F.linear(x.float(), w32), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_native_bf16_packs_bf16_and_takes_it_at_every_row_count(monkeypatch):
    """AVX512-BF16 or AMX: a bf16 weight's packed copy is bf16 (half the bytes of the fp32 one)
    and every row count runs through it, decode's one row and chunks past ``PACK_MAX_ROWS``
    included (the fastest form there at every count measured).  Each output is the exact
    product rounded once to bf16, up to fp32 summation error (K u sum |x w|, K = 512).  (With
    autograd on, as here, the C GEMV that takes decode's rows in inference declines:
    tests/kernels/test_cpu_gemv_native.py.)"""
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", False)
    calls = []
    real = linear_mod.packed_linear
    monkeypatch.setattr(linear_mod, "packed_linear", lambda x, p: (calls.append(1), real(x, p))[1])
    w = big_weight(torch.bfloat16)
    w_t = w.t().contiguous().t()  # a routed expert's [out, in] view of input-major storage
    g = torch.Generator().manual_seed(5)
    for weight in (w, w_t):
        packed = linear_mod.pack_weight(weight)
        assert packed.dtype == torch.bfloat16
        assert linear_mod.packed_bytes(weight) == weight.numel() * 2
        for rows in (1, 17, linear_mod.PACK_MAX_ROWS + 1):
            x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
            calls.clear()
            out = linear_mod.linear(x, weight, packed)
            assert calls == [1], f"{rows} rows did not take the packed bf16 GEMM"
            assert out.dtype == torch.bfloat16
            exact = F.linear(x.double(), w.double())
            sums = x.double().abs() @ w.double().abs().T
            assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 + 4e-5 * sums).all()
    w32 = big_weight()  # fp32 weights keep the fp32 packing and its row range
    assert linear_mod.pack_weight(w32).dtype == torch.float32
    assert linear_mod.packed_bytes(w32) == w32.numel() * 4


@needs_onednn
def test_bf16_packed_gemm_of_few_rows_runs_padded_and_batch_invariant(monkeypatch):
    """1-3 rows through a bf16 packed copy run as ``PAD_ROWS`` rows (oneDNN is faster there),
    so a row's bits do not depend on how many rows share its step, up to ``PAD_ROWS``; a
    transposed (routed expert) weight's copy too.  (This is the path where the C GEMV does not
    run: autograd on, as here, or a CPU without AVX-512.)"""
    monkeypatch.setattr(linear_mod, "_EMULATED_BF16", False)
    shapes = []
    real = linear_mod.packed_linear
    monkeypatch.setattr(linear_mod, "packed_linear",
                        lambda x, p: (shapes.append(tuple(x.shape)), real(x, p))[1])
    w = big_weight(torch.bfloat16)
    x = torch.randn(linear_mod.PAD_ROWS, w.shape[1],
                    generator=torch.Generator().manual_seed(9)).bfloat16()
    for weight in (w, w.t().contiguous().t()):
        packed = linear_mod.pack_weight(weight)
        full = linear_mod.linear(x, weight, packed)
        for rows in range(1, linear_mod.PAD_ROWS):
            shapes.clear()
            out = linear_mod.linear(x[:rows].view(1, rows, -1), weight, packed)
            assert shapes == [(linear_mod.PAD_ROWS, w.shape[1])]
            assert out.shape == (1, rows, w.shape[0])
            assert torch.equal(out[0], full[:rows])
