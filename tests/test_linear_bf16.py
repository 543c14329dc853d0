"""bf16 GEMMs on CPUs that only emulate bf16: prefill-sized ones run in fp32 and round once."""

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
