"""Symmetric per-row INT8 quantisation: torch reference properties and Triton == reference.

The Triton kernels run under the Triton interpreter in a child process (`run_interpreted`), so
`TRITON_INTERPRET` never leaks into this test process.
"""

from __future__ import annotations

import pytest
import torch

from kernels.int8_quant import dequantize_int8, quantize_int8
from kernels.int8_quant.naive import (
    INT8_MAX,
    SCALE_EPS,
    dequantize_int8_ref,
    quantize_int8_inplace,
    quantize_int8_ref,
)
from kernels.interpreted import run_interpreted

# Ties: with amax = 127 the scale is exactly 1, so x / s lands on .5 and round-half-even shows.
TIES_ROW = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]
TIES_Q = [127, 0, 2, 2, 0, -2, -2, 126]


def _make(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(name))
    if name == "kda_units":  # [N, V]: one row per KDA unit
        return torch.randn(6, 8, generator=gen) * 3.0
    if name == "gdn_heads":  # [L, H, K, V]: one scale per (layer, head, k)
        x = torch.randn(2, 3, 4, 8, generator=gen)
        x[1, 2] = 0.0  # a whole zero head
        return x
    if name == "long_rows":  # V spans two chunks of 1024 with a tail
        return torch.randn(5, 1300, generator=gen) * 1e3
    if name == "odd_v":
        x = torch.randn(3, 7, generator=gen)
        x[1] = 0.0
        return x
    if name == "tiny":  # amax below the 1e-8 floor, and exact zeros
        x = torch.randn(4, 16, generator=gen) * 1e-9
        x[0] = 0.0
        return x
    if name == "ties":
        halves = torch.randint(-254, 255, (40, 31), generator=gen).float() / 2
        rows = torch.cat([torch.full((40, 1), 127.0), halves], dim=1)
        return torch.cat([torch.tensor([TIES_ROW]).repeat(1, 4), rows], dim=0)  # [41, 32]
    if name == "bf16":
        return (torch.randn(3, 2, 16, generator=gen) * 5).to(torch.bfloat16)
    if name == "non_finite":  # corrupted state: NaN, +-inf, both; V spans two chunks
        x = torch.randn(6, 1300, generator=gen)
        x[0, 5], x[1, 1200], x[2, 0] = float("nan"), float("inf"), float("-inf")
        x[3, 7], x[3, 1100] = float("inf"), float("nan")
        return x  # rows 4, 5 stay finite
    raise KeyError(name)


CASES = ["kda_units", "gdn_heads", "long_rows", "odd_v", "tiny", "ties", "bf16"]
TRITON_CASES = [*CASES, "non_finite"]
NON_FINITE_SCALES = ["nan", "inf", "inf", "nan"]  # rows 0-3 of "non_finite"


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Identical dtype and bits, NaN where the reference has NaN."""
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- reference properties


@pytest.mark.parametrize("name", CASES)
def test_reference_quantisation_properties(name):
    x = _make(name)
    q, scale = quantize_int8(x)  # CPU: the reference
    xf = x.float()
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    amax = xf.abs().amax(dim=-1)
    assert torch.equal(scale, amax.clamp_min(SCALE_EPS) / INT8_MAX)
    assert int(q.abs().max()) <= INT8_MAX
    # The largest element of each non-zero row maps to +-127.
    nonzero = amax >= SCALE_EPS
    assert (q.abs().amax(dim=-1)[nonzero] == INT8_MAX).all()
    x_hat = dequantize_int8(q, scale)
    assert x_hat.dtype == torch.float32
    # Error bound |x' - x| <= s / 2, plus an ulp or two of |x| for the rounded product q * s.
    assert ((x_hat - xf).abs() <= scale[..., None] / 2 + xf.abs() * 2.0**-22).all()
    zero_rows = (xf == 0).all(dim=-1)
    assert (q[zero_rows] == 0).all() and (x_hat[zero_rows] == 0).all()


def test_reference_rounds_half_to_even():
    q, scale = quantize_int8_ref(torch.tensor([TIES_ROW]))
    assert scale.tolist() == [1.0]
    assert q.tolist() == [TIES_Q]


def test_reference_clips_and_handles_zero_row():
    q, scale = quantize_int8_ref(torch.zeros(2, 5))
    assert (q == 0).all() and torch.equal(scale, torch.full((2,), SCALE_EPS) / INT8_MAX)
    q, _ = quantize_int8_ref(torch.tensor([[-3.0, 3.0, 1.0]]))
    assert q.tolist() == [[-127, 127, 42]]


def test_dequantize_writes_out_and_validates():
    q, scale = quantize_int8_ref(_make("kda_units"))
    out = torch.full(q.shape, float("nan"))
    result = dequantize_int8(q, scale, out=out)
    assert result is out and torch.equal(out, q.float() * scale[:, None])
    with pytest.raises(ValueError):
        dequantize_int8(q, scale, out=torch.empty(q.shape, dtype=torch.float64))
    with pytest.raises(ValueError):
        dequantize_int8(q, scale[:-1])


@pytest.mark.parametrize("with_buffers", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_inplace_matches_reference_exactly(name, with_buffers):
    x = _make(name).float()
    q_ref, scale_ref = quantize_int8_ref(x)
    work = x.clone()
    q_buf = torch.full(x.shape, 99, dtype=torch.int8) if with_buffers else None
    q, scale = quantize_int8_inplace(work, q_buf, torch.empty_like(x) if with_buffers else None)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert (q is q_buf) == with_buffers


def test_reference_keeps_non_finite_rows_non_finite():
    """A NaN row gets a NaN scale, an inf row an inf scale, their codes are 0 and they load back
    as NaN: a checkpoint of corrupted state never turns finite."""
    x = _make("non_finite")
    for q, scale in (quantize_int8_ref(x), quantize_int8_inplace(x.clone())):
        assert [str(v) for v in scale[:4].tolist()] == NON_FINITE_SCALES
        assert (q[:4] == 0).all() and dequantize_int8(q, scale)[:4].isnan().all()
        finite = quantize_int8_ref(x[4:])
        assert torch.equal(q[4:], finite[0]) and torch.equal(scale[4:], finite[1])


def test_inplace_rejects_what_it_cannot_overwrite():
    with pytest.raises(ValueError):
        quantize_int8_inplace(torch.randn(4, 6).t())
    with pytest.raises(ValueError):
        quantize_int8_inplace(torch.randn(4, 6, dtype=torch.float64))


# ---------------------------------------------------------------- Triton vs reference


@pytest.fixture(scope="module")
def triton_results() -> dict[str, tuple]:
    calls = []
    for name in TRITON_CASES:
        x = _make(name)
        q, scale = quantize_int8_ref(x)
        calls += [
            ("quantize_int8_triton", (x,)),
            ("dequantize_int8_triton", (q, scale)),
            ("dequantize_int8_triton", (q, scale, torch.full(q.shape, float("nan")))),
        ]
    out = run_interpreted("kernels.int8_quant.triton", calls)
    return {name: tuple(out[3 * i : 3 * i + 3]) for i, name in enumerate(TRITON_CASES)}


@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_reference_exactly(name, triton_results):
    (q_triton, scale_triton), x_hat_triton, x_hat_out = triton_results[name]
    q, scale = quantize_int8_ref(_make(name))
    assert_same(q_triton, q)
    assert_same(scale_triton, scale)
    x_hat = dequantize_int8_ref(q, scale)
    assert_same(x_hat_triton, x_hat)
    assert_same(x_hat_out, x_hat)


def test_triton_keeps_non_finite_rows_non_finite(triton_results):
    # Before the fix a NaN became code -127 under a finite scale (GPU max.f32 drops NaN).
    (q_triton, scale_triton), x_hat, _ = triton_results["non_finite"]
    assert [str(v) for v in scale_triton[:4].tolist()] == NON_FINITE_SCALES
    assert (q_triton[:4] == 0).all() and x_hat[:4].isnan().all()


def test_triton_rounds_half_to_even(triton_results):
    (q_triton, _), _, _ = triton_results["ties"]
    assert q_triton[0, : len(TIES_Q)].tolist() == TIES_Q


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_matches_reference():
    # Kimi-Linear-like rank: 20 layers x 4 heads x 128 channels, V = 128; plus ties.
    x = torch.cat([torch.randn(20 * 4 * 128, 128) * 2, _make("ties").repeat(1, 4)[:, :128]])
    x = torch.cat([x, _make("non_finite")[:, :128]])
    q, scale = quantize_int8(x.cuda())
    q_ref, scale_ref = quantize_int8_ref(x)
    assert_same(q.cpu(), q_ref)
    assert_same(scale.cpu(), scale_ref)
    assert_same(dequantize_int8(q, scale).cpu(), dequantize_int8_ref(q_ref, scale_ref))
