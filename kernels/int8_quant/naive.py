"""Torch reference of the INT8 quantiser (rules: this package's docstring); the Triton kernels
and the C library equal it bit for bit."""

from __future__ import annotations

import torch

INT8_MAX = 127
SCALE_EPS = 1e-8


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_int8`."""
    x = x.float()  # [..., V]
    amax = x.abs().amax(dim=-1)  # [...]
    # Divide by a tensor, not a Python scalar: CUDA turns `t / 127` into `t * (1 / 127)`, which
    # is not the correctly rounded quotient the kernel computes.
    scale = amax.clamp_min(SCALE_EPS) / torch.full_like(amax, INT8_MAX)  # [...]
    q = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_int8_inplace(
    x: torch.Tensor, q: torch.Tensor | None = None, work: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8_ref` of a contiguous fp32 `x`, computed in place: x is overwritten.

    The same operations in the same order (identical bits) without fp32 temporaries: `q` (int8)
    and `work` (fp32), both contiguous and shaped like x, receive the result and |x| if given.
    The checkpoint pool's CPU store quantises its staging buffer this way.
    """
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"need a contiguous float32 tensor, got {x.dtype} {tuple(x.stride())}")
    amax = (x.abs() if work is None else torch.abs(x, out=work)).amax(dim=-1)  # [...]
    scale = amax.clamp_min_(SCALE_EPS).div_(torch.full_like(amax, INT8_MAX))  # [...]
    x.div_(scale[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
    q = x.to(torch.int8) if q is None else q.copy_(x)  # the same float -> int8 cast
    return q, scale


def dequantize_int8_ref(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of `dequantize_int8`."""
    x = q.float() if out is None else out.copy_(q)  # int8 -> fp32 is exact
    return x.mul_(scale[..., None])  # [..., V]


def check_dequantize_args(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None) -> None:
    if q.dtype != torch.int8 or scale.shape != q.shape[:-1]:
        raise ValueError(
            f"want int8 q [..., V] and scale [...], got {q.dtype} {tuple(scale.shape)}"
        )
    if out is not None and (
        out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous()
    ):
        raise ValueError("out must be a contiguous float32 tensor shaped like q")
