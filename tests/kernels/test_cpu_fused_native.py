"""The fused C passes of a GDN layer (``kernels/cpu_fused``) against their torch forms:
- the gated output norm (``GatedRMSNorm``, silu gate) from the delta rule's FP32 output: in
  bf16, at most one bf16 unit in the last place from torch's result, and only on a small share
  of the values (its mean and exponential run in another order); in FP32, to rounding;
- q and k L2-normalised and v converted, straight from the conv's output;
- the hidden-state and per-head RMS norms in each architecture's roundings;
- AVX-512 and portable forms give the same bits; what they cannot run they decline (None).
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused, native_build
from kernels.cpu_fused import (
    gated_rmsnorm,
    l2norm_qkv,
    native_library,
    rmsnorm,
    silu_mul,
    simd_available,
)
from kernels.delta_rule.naive import l2norm_rsqrt
from model_runner.layers.norm import GatedRMSNorm, RMSNorm

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler here")


def _simd(dim: int) -> bool:
    """The form a test runs: AVX-512 where the CPU has it and the rows allow, else portable."""
    return dim % 16 == 0 and simd_available()


def _norm_inputs(dtype, tokens=37, heads=3, dim=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(tokens, heads, dim, generator=gen) * 0.3
    wide = torch.randn(tokens, 2 * heads * dim, generator=gen).to(dtype) * 4  # [z | other]
    z = wide[:, : heads * dim]  # a strided slice, as the projection's split gives it
    norm = GatedRMSNorm(dim, 1e-6, dtype, gate="silu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + 1)
    return o, z, norm


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values)."""
    as_int = [x.view(torch.int16).to(torch.int32) for x in (a, b)]
    return (as_int[0] - as_int[1]).abs()


@pytest.mark.parametrize("dim", [128, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_gated_norm_matches_torch(dtype, dim):
    o, z, norm = _norm_inputs(dtype, dim=dim)
    got = gated_rmsnorm(o, z, norm.weight.detach().float(), 1e-6, simd=_simd(dim))
    want = norm(o.to(dtype).reshape(-1, dim), z.reshape(-1, dim))
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:
        same_sign = (got.float() * want.float()) > 0
        ulps = _ulps_bf16(got[same_sign], want[same_sign])
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.02
        assert torch.equal(got[~same_sign].float().abs() < 1e-30,
                           want[~same_sign].float().abs() < 1e-30)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not simd_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_simd_and_portable_forms_give_the_same_bits(dtype, dim):
    o, z, norm = _norm_inputs(dtype, dim=dim)
    weight = norm.weight.float()
    assert torch.equal(gated_rmsnorm(o, z, weight, 1e-6),
                       gated_rmsnorm(o, z, weight, 1e-6, simd=False))
    x = torch.randn(9, 2 * 2 * dim + 3 * dim).to(dtype)
    fast, portable = l2norm_qkv(x, 2, dim), l2norm_qkv(x, 2, dim, simd=False)
    assert all(torch.equal(a, b) for a, b in zip(fast, portable))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_l2norm_qkv_matches_torch(dtype):
    key_heads, dim, values = 4, 128, 8 * 128
    wide = torch.randn(50, 2 * key_heads * dim + values + 7).to(dtype)
    x = wide[:, :-7]  # rows at a stride wider than the row
    q, k, v = l2norm_qkv(x, key_heads, dim, simd=_simd(dim))
    tq, tk, tv = x.split([key_heads * dim, key_heads * dim, values], dim=-1)
    assert torch.allclose(q, l2norm_rsqrt(tq.reshape(50, key_heads, dim).float()),
                          rtol=0, atol=3e-7)
    assert torch.allclose(k, l2norm_rsqrt(tk.reshape(50, key_heads, dim).float()),
                          rtol=0, atol=3e-7)
    assert torch.equal(v, tv.float())


def test_declines_what_it_does_not_run():
    o, z, norm = _norm_inputs(torch.bfloat16)
    weight = norm.weight.detach().float()
    assert gated_rmsnorm(o, z, weight, 1e-6) is None  # autograd on
    with torch.inference_mode():
        assert gated_rmsnorm(o.double(), z, weight, 1e-6) is None
        assert gated_rmsnorm(o, z.float().half(), weight, 1e-6) is None
        assert gated_rmsnorm(o, z[:, :-1], weight, 1e-6) is None
        assert gated_rmsnorm(o.transpose(0, 1), z, weight, 1e-6) is None
        assert l2norm_qkv(z[:, :8], 1, 8) is None  # no room for v
        native_build.set_enabled(False)
        try:
            assert gated_rmsnorm(o, z, weight, 1e-6) is None
            assert l2norm_qkv(z, 1, 64) is None
            fallback = norm.from_fp32(o, z)  # the torch form
        finally:
            native_build.set_enabled(True)
        assert torch.equal(fallback, norm(o.to(z.dtype).reshape(-1, 128), z.reshape(-1, 128)))
        assert (gated_rmsnorm(o, z, weight, 1e-6) is not None) == simd_available()
        assert gated_rmsnorm(o, z, weight, 1e-6, simd=False) is not None
        assert gated_rmsnorm(o[..., :40].contiguous(), z[:, :120], weight[:40], 1e-6) is None


def test_declines_on_a_cpu_without_avx512(monkeypatch):
    """The portable forms are references, slower than torch: an AVX2-only CPU takes torch."""
    monkeypatch.setattr(cpu_fused, "simd_available", lambda: False)
    o, z, norm = _norm_inputs(torch.bfloat16)
    with torch.inference_mode():
        assert gated_rmsnorm(o, z, norm.weight.float(), 1e-6) is None
        assert l2norm_qkv(torch.randn(3, 5 * 128), 2, 128) is None
        assert silu_mul(torch.randn(3, 256)) is None
        assert torch.equal(norm.from_fp32(o, z),
                           norm(o.to(z.dtype).reshape(-1, 128), z.reshape(-1, 128)))


@pytest.mark.parametrize("dim", [128, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_silu_mul_matches_torch(dtype, dim):
    wide = (torch.randn(33, 2 * dim + 5) * 3).to(dtype)
    x = wide[:, :-5]  # rows at a stride wider than the row
    got = silu_mul(x, simd=_simd(dim))
    assert torch.equal(got, silu_mul(x, simd=False))
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    if dtype == torch.bfloat16:
        same_sign = (got.float() * want.float()) > 0
        ulps = _ulps_bf16(got[same_sign], want[same_sign])
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.02
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


# (unit_offset, fp32_product): Qwen's (1 + w) in FP32, OLMo's FP32 product, Llama's rounding
NORM_ORDERS = [(True, False), (False, True), (False, False)]


@pytest.mark.parametrize("order", NORM_ORDERS, ids=["qwen", "olmo", "llama"])
@pytest.mark.parametrize("dim", [1024, 256, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.inference_mode()
def test_rmsnorm_matches_torch(dtype, dim, order):
    """``RMSNorm`` in C against its torch form, on strided rows as the per-head norms see them
    (q of q_proj's [query | gate] heads): the same bf16 values here (the sum of squares runs
    in another order, which bf16 hides), FP32 to rounding; the AVX-512 and portable forms
    give the same bits; rows it cannot take (D % 16) stay in torch."""
    unit_offset, fp32_product = order
    norm = RMSNorm(dim, 1e-6, dtype, unit_offset=unit_offset, fp32_product=fp32_product)
    gen = torch.Generator().manual_seed(dim)
    norm.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0 if unit_offset else 1))
    x = (torch.randn(7, 3, 2 * dim, generator=gen) * 3).to(dtype)[..., :dim]
    got = norm(x)
    native_build.set_enabled(False)
    try:
        want = norm(x)
    finally:
        native_build.set_enabled(True)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:
        same_sign = (got.float() * want.float()) > 0
        assert int(_ulps_bf16(got[same_sign], want[same_sign]).max()) <= 1
        assert float((got != want).float().mean()) < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weight = norm._fp32_weight()
    fast = rmsnorm(x, weight, 1e-6, norm._rounds_first)
    assert (fast is None) == (dim % 16 != 0 or not simd_available())
    if fast is not None:
        assert torch.equal(fast, got)
        assert torch.equal(fast, rmsnorm(x, weight, 1e-6, norm._rounds_first, simd=False))
