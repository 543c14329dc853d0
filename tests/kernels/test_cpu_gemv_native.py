"""A decode step's GEMMs in C (``kernels.gemv.gemv``):
- each output is the exact product rounded once to bf16, up to FP32 summation error, and at
  most one bf16 unit in the last place from torch's bf16 GEMM, on under 1 % of the values;
- the AVX-512 and portable forms give the same bits;
- a row's bits do not depend on the rows beside it;
- ``linear`` takes it for a decode step's few rows and oneDNN's packed GEMM for more; what it
  cannot run it declines (None).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.bf16_checks import assert_bf16_close

from kernels.gemv import GEMV_MAX_ROWS, gemv, native_library, simd_available
from model_runner.layers import linear as linear_mod

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")
needs_simd = pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")


def operands(rows: int, out: int = 203, k: int = 640, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(out, k, generator=g) * 0.05).bfloat16()
    return x, w


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@torch.inference_mode()
def test_rounds_the_exact_product_once(rows):
    """|out - exact| <= half a bf16 unit of |exact| plus FP32 summation error (K u sum|x w|),
    and torch's bf16 GEMM agrees to one unit on under 1 % of the values.  Both forms, 203 weight
    rows (four at a time and a remainder of three)."""
    x, w = operands(rows, seed=rows)
    exact = F.linear(x.double(), w.double())
    sums = x.double().abs() @ w.double().abs().T
    for simd in {simd_available(), False}:
        got = gemv(x, w, simd=simd)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, w.shape[0])
        assert ((got.double() - exact).abs()
                <= exact.abs() * 2.0**-8 + x.shape[1] * 2.0**-24 * sums).all()
        assert_bf16_close(got, F.linear(x, w))


@needs_simd
@torch.inference_mode()
def test_simd_and_portable_forms_give_the_same_bits():
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x, w = operands(rows, out=37, k=3584, seed=10 + rows)
        assert torch.equal(gemv(x, w), gemv(x, w, simd=False))


@torch.inference_mode()
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    x, w = operands(GEMV_MAX_ROWS, seed=3)
    full = gemv(x, w, simd=simd_available())
    for start in range(GEMV_MAX_ROWS):
        for stop in range(start + 1, GEMV_MAX_ROWS + 1):
            assert torch.equal(gemv(x[start:stop], w, simd=simd_available()), full[start:stop])


@needs_simd
@torch.inference_mode()
def test_linear_takes_it_for_a_decode_steps_rows(monkeypatch):
    """Up to ``GEMV_MAX_ROWS`` rows of a bf16 weight go through the kernel (oneDNN's packed GEMM
    is not called), more rows through the packed GEMM."""
    calls = []
    real = linear_mod.packed_linear
    monkeypatch.setattr(linear_mod, "packed_linear",
                        lambda x, p: (calls.append(x.numel() // x.shape[-1]), real(x, p))[1])
    _, w = operands(1, out=1024, k=1024)
    packed = linear_mod.pack_weight(w)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x, _ = operands(rows, out=1024, k=1024, seed=rows)
        got = linear_mod.linear(x.view(1, rows, -1), w, packed)
        assert got.shape == (1, rows, 1024)
        if rows <= GEMV_MAX_ROWS:
            assert calls == [] and torch.equal(got[0], gemv(x, w))
        else:
            assert calls == [rows]


@torch.inference_mode()
def test_declines_what_it_does_not_run():
    x, w = operands(2)
    assert gemv(x.float(), w) is None  # dtypes differ
    assert gemv(x.float(), w.float()) is None  # FP32
    assert gemv(operands(GEMV_MAX_ROWS + 1)[0], w) is None
    assert gemv(x[:, :624], w[:, :624]) is None  # K not a multiple of 32
    assert gemv(x, w.t().contiguous().t()) is None  # not row-major
    assert gemv(x[:, :320], w) is None  # K differs
    with torch.enable_grad():
        assert gemv(x, w) is None
