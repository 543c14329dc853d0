"""A decode step's GEMMs in C (``kernels.gemv.gemv``):
- each output is the exact product rounded once to bf16, up to FP32 summation error, and at
  most one bf16 unit in the last place from torch's bf16 GEMM, on under 1 % of the values;
- the AVX-512 and portable forms give the same bits;
- a row's bits do not depend on the rows beside it;
- ``linear`` takes it for a decode step's few rows and oneDNN's packed GEMM for more; what it
  cannot run it declines (None);
- over a weight's coded copy (``code_weight``: 12 bits an element) it gives the same bits,
  whatever the weight holds (zeros, subnormals, infinities, NaNs, blocks too wide to code), and
  ``linear`` streams the copy it is given, and its rows come back exactly (an input
  embedding's lookup from its tied head's copy).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.bf16_checks import assert_bf16_close

from kernels.gemv import (
    CODE_BLOCK,
    GEMV_MAX_ROWS,
    RAW,
    code_weight,
    coded_rows,
    gemv,
    native_library,
    simd_available,
)
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


def awkward_weight(out: int, k: int, seed: int) -> torch.Tensor:
    """A Gaussian bf16 weight salted with what the coding must keep exactly: signed zeros,
    subnormals, the least normal exponents, infinities, NaNs, and huge and tiny values side by
    side (their blocks do not fit one window)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, k, generator=g) * 0.03).bfloat16()
    flat = w.view(-1)
    salt = {97: 0.0, 101: -0.0, 103: 1e-39, 107: -3e-39, 109: 2.0**-126, 1409: -2.0**-125,
            1499: float("inf"), 1511: float("-inf"), 1523: float("nan")}
    for step, value in salt.items():
        flat[step % 13 :: step] = value
    flat[10::1531] = 3e4  # with the Gaussian values: too wide for one window
    w[0, :CODE_BLOCK] = torch.logspace(-30, 30, CODE_BLOCK).bfloat16()
    return w


@needs_simd
@pytest.mark.parametrize("out,k", [(2, 64), (5, 640), (203, 1024), (37, 3584)])
@torch.inference_mode()
def test_the_coded_copy_gives_the_same_bits(out, k):
    """Every row count, both forms, against the plain kernel on the weight itself (compared as
    bits: NaN outputs included)."""
    w = awkward_weight(out, k, seed=out)
    coded = code_weight(w)
    assert coded.shape == (out, k)
    assert (coded.head == RAW).any() and (coded.head != RAW).any()  # both kinds of blocks
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = gemv(x, w).view(torch.int16)
        for simd in (True, False):
            assert torch.equal(gemv(x, w, simd=simd, coded=coded).view(torch.int16), want)


@needs_simd
@torch.inference_mode()
def test_a_gaussian_weight_codes_into_under_four_fifths_of_its_bytes():
    w = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    coded = code_weight(w)
    assert (coded.head == RAW).float().mean() < 0.05  # blocks kept with their high bytes
    assert coded.nbytes < 0.8 * w.nbytes


@needs_simd
@torch.inference_mode()
def test_code_weight_declines_what_the_kernel_does_not_take():
    _, w = operands(1, out=64, k=640)
    assert code_weight(w[:, :608].contiguous()) is None  # K not a multiple of 64
    assert code_weight(w.float()) is None
    assert code_weight(w.t()) is None  # not row-major


@needs_simd
@torch.inference_mode()
def test_linear_streams_the_coded_copy():
    """A decode step's rows read the coded copy: changed after coding, the weight's new values
    reach only the GEMMs of more rows."""
    _, w = operands(1, out=96, k=640)
    coded, before = code_weight(w), w.clone()
    w.mul_(2)
    for rows in (1, GEMV_MAX_ROWS):
        x, _ = operands(rows, out=96, k=640, seed=rows)
        assert torch.equal(linear_mod.linear(x, w, coded=coded), gemv(x, before))
    x, _ = operands(GEMV_MAX_ROWS + 1, out=96, k=640)
    assert torch.equal(linear_mod.linear(x, w, coded=coded), linear_mod.linear(x, w))


@needs_simd
@torch.inference_mode()
def test_coded_rows_are_the_weights_rows():
    """Any rows, repeated, in any shape of ids, with the bits of ``F.embedding`` (NaN, inf,
    subnormals and raw blocks included), also for a lookup big enough to split among threads;
    an id out of range raises as ``F.embedding`` does."""
    w = awkward_weight(203, 640, seed=3)
    coded = code_weight(w)
    for ids in (torch.tensor([0]), torch.tensor([[202, 0, 5], [5, 5, 17]]),
                torch.randint(0, 203, (300,), generator=torch.Generator().manual_seed(1))):
        for simd in (True, False):
            assert torch.equal(coded_rows(coded, ids, simd=simd).view(torch.int16),
                               F.embedding(ids, w).view(torch.int16))
    for bad in (torch.tensor([203]), torch.tensor([-1])):
        with pytest.raises(IndexError):
            coded_rows(coded, bad)
