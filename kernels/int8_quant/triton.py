"""Triton kernels of the INT8 quantiser (rules: this package's docstring), for CUDA tensors or
CPU ones under the Triton interpreter.

They reproduce the torch reference (`naive.py`) bit for bit: both divide with IEEE
round-to-nearest (`tl.div_rn`; Triton's plain `/` may be approximate on GPUs) and round half to
even (done explicitly in Triton, which has no such rounding builtin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int8_quant.naive import INT8_MAX, SCALE_EPS, check_dequantize_args


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"need a non-empty last dim, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])  # [N, V]


def _block_sizes(num_rows: int, dim: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(dim), 1024)  # longer rows are walked in chunks
    block_n = min(triton.next_power_of_2(num_rows), max(1, 4096 // block_v))
    return block_n, block_v


@triton.jit
def _round_half_even(y):
    # Exact for |y| < 2**23: y - floor(y) and the parity test are representable in fp32.
    down = tl.floor(y)
    frac = y - down
    is_odd = (down - 2.0 * tl.floor(down * 0.5)) != 0.0
    round_up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    return tl.where(round_up, down + 1.0, down)


@triton.jit
def _quantize_int8_kernel(
    x_ptr, q_ptr, scale_ptr, num_rows, dim, x_stride, q_stride,
    EPS: tl.constexpr, QMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    num_nan = tl.zeros([BLOCK_N], dtype=tl.int32)
    for v0 in range(0, dim, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = row_ok[:, None] & (cols < dim)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        a = tl.abs(x.to(tl.float32))
        amax = tl.maximum(amax, tl.max(a, axis=1))  # NaN-blind on GPUs (max.f32 drops NaN)
        num_nan += tl.sum((a != a).to(tl.int32), axis=1)
    scale = tl.div_rn(tl.maximum(amax, EPS), QMAX)  # [BLOCK_N]; inf stays inf
    scale = tl.where(num_nan > 0, float("nan"), scale)
    tl.store(scale_ptr + rows64, scale, mask=row_ok)
    for v0 in range(0, dim, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < dim)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        y = _round_half_even(tl.div_rn(x.to(tl.float32), scale[:, None]))
        # NaN quotients (a NaN scale, or inf / inf) become code 0, as torch's cast does on CPU;
        # tl.minimum / tl.maximum would clip them to -127.
        q = tl.where(y == y, tl.minimum(tl.maximum(y, -QMAX), QMAX), 0.0).to(tl.int8)
        tl.store(q_ptr + rows64[:, None] * q_stride + cols[None, :], q, mask=mask)


@triton.jit
def _dequantize_int8_kernel(
    q_ptr, scale_ptr, out_ptr, num_rows, dim, q_stride, out_stride,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # grid: (row blocks, column blocks)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < dim)[None, :]
    rows64 = rows.to(tl.int64)
    scale = tl.load(scale_ptr + rows64, mask=row_ok, other=0.0)  # [BLOCK_N]
    q = tl.load(q_ptr + rows64[:, None] * q_stride + cols[None, :], mask=mask, other=0)
    x = q.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows64[:, None] * out_stride + cols[None, :], x, mask=mask)


def quantize_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `quantize_int8` (CUDA, or CPU under the Triton interpreter)."""
    rows = _rows(x)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows, dim = rows.shape
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)  # [..., V]
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # [...]
    if num_rows == 0:
        return q, scale
    block_n, block_v = _block_sizes(num_rows, dim)
    _quantize_int8_kernel[(triton.cdiv(num_rows, block_n),)](
        rows, q, scale, num_rows, dim, rows.stride(0), dim,
        EPS=SCALE_EPS, QMAX=float(INT8_MAX), BLOCK_N=block_n, BLOCK_V=block_v,
    )  # fmt: skip
    return q, scale


def dequantize_int8_triton(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton implementation of `dequantize_int8` (CUDA, or CPU under the Triton interpreter)."""
    check_dequantize_args(q, scale, out)
    rows = _rows(q).contiguous()  # [N, V]
    scale = scale.reshape(-1).float().contiguous()  # [N]
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    num_rows, dim = rows.shape
    if num_rows == 0:
        return out
    block_n, block_v = _block_sizes(num_rows, dim)
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(dim, block_v))
    _dequantize_int8_kernel[grid](
        rows, scale, out, num_rows, dim, dim, dim, BLOCK_N=block_n, BLOCK_V=block_v
    )
    return out
