"""Tolerance checks for the C kernels that sum in another order than torch: in bf16, results
that differ from torch's differ by one unit in the last place at most, never in sign, and on
a small share of the values."""

from __future__ import annotations

import torch


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values)."""
    as_int = [x.view(torch.int16).to(torch.int32) for x in (a, b)]
    return (as_int[0] - as_int[1]).abs()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, max_share: float = 0.01) -> None:
    differ = got != want
    assert bool(((got.float() * want.float())[differ] > 0).all()), "a value changed sign"
    if bool(differ.any()):
        assert int(ulps_bf16(got[differ], want[differ]).max()) <= 1
    assert float(differ.float().mean()) < max_share
