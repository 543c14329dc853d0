"""Symmetric per-row INT8 quantisation of recurrent-state checkpoints.

A row is the value dim V of one (layer, head, key channel): for GDN the K rows of each head state
`[K, V]`, for KDA one unit. Per row: `s = max(amax(|x|), 1e-8) / 127`,
`q = clip(round_half_even(x / s), -127, 127)` (int8); dequantisation is `x' = q * s` in FP32.

Non-finite rows stay non-finite, so corrupted state cannot turn finite in a checkpoint: a row
holding a NaN gets a NaN scale, one holding +-inf (and no NaN) an inf scale, and every code of such
a row is 0 (the quotients are NaN or 0); dequantised, the row is all NaN.

Modules, each equal to the reference bit for bit:
    naive   torch reference (`*_ref`), and the in-place form the CPU store quantises with
    triton  Triton kernels (`*_triton`), CUDA or the Triton interpreter
The C library of `kernels/ragged_state/native.py` quantises inside its copies with the same bits.
This module's `quantize_int8` / `dequantize_int8` use Triton for CUDA tensors, the reference
otherwise.
"""

from __future__ import annotations

import torch

from kernels.int8_quant.naive import check_dequantize_args, dequantize_int8_ref, quantize_int8_ref
from kernels.int8_quant.triton import dequantize_int8_triton, quantize_int8_triton


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` `[..., V]` per row over V; returns q `[..., V]` int8 and scale `[...]` fp32.

    `s = max(amax(|x|), 1e-8) / 127`, `q = clip(round(x / s), -127, 127)`, round half to even.
    Uses Triton on CUDA tensors and the torch reference otherwise; both give identical bits.
    """
    return quantize_int8_triton(x) if x.is_cuda else quantize_int8_ref(x)


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantise q `[..., V]` int8 with scale `[...]` into FP32 `q * s`, written to `out` if given.

    `out` must be a contiguous float32 tensor shaped like q. Returns the result tensor.
    """
    if q.is_cuda:
        return dequantize_int8_triton(q, scale, out)
    check_dequantize_args(q, scale, out)
    return dequantize_int8_ref(q, scale, out)
