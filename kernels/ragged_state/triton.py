"""Triton kernels of the ragged gather / scatter (buffers: this package's docstring), for CUDA
tensors or CPU ones under the Triton interpreter; equal to `naive.py` bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ragged_state.layout import check_gather_args, check_scatter_args

Tensor = torch.Tensor


def _block_sizes(num_rows: int, dim: int) -> tuple[int, int]:
    # About 4096 elements per program; a row is split when D is large (GDN heads: K*V).
    block_d = min(triton.next_power_of_2(dim), 1024)
    block_r = min(triton.next_power_of_2(max(num_rows, 1)), max(1, 4096 // block_d))
    return block_r, block_d


# ---------------------------------------------------------------- gather: pool -> checkpoint


@triton.jit
def _gather_units_kernel(
    pool_ptr, ckpt_ptr, src_slots_ptr, dst_slots_ptr, unit_layer_ptr, unit_index_ptr,
    num_rows, dim, pool_stride_l, pool_stride_s, pool_stride_u, ckpt_stride_c, ckpt_stride_r,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # grid: (row blocks, requests B, column blocks)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = rows < num_rows
    col_ok = cols < dim
    src = tl.load(src_slots_ptr + tl.program_id(1)).to(tl.int64)
    dst = tl.load(dst_slots_ptr + tl.program_id(1)).to(tl.int64)
    layer = tl.load(unit_layer_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    unit = tl.load(unit_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src_off = layer * pool_stride_l + src * pool_stride_s + unit * pool_stride_u  # [BLOCK_R]
    is_unit = (layer >= 0)[:, None] & col_ok[None, :]  # padding rows read as zero
    vals = tl.load(pool_ptr + src_off[:, None] + cols[None, :], mask=is_unit, other=0.0)
    dst_off = dst * ckpt_stride_c + rows.to(tl.int64) * ckpt_stride_r  # [BLOCK_R]
    tl.store(ckpt_ptr + dst_off[:, None] + cols[None, :], vals, mask=row_ok[:, None] & col_ok)


def gather_units_triton(pool: Tensor, src_slots: Tensor, unit_layer: Tensor, unit_index: Tensor,
                        ckpt: Tensor, dst_slots: Tensor) -> Tensor:
    """Triton implementation of `gather_units` (CUDA, or CPU under the Triton interpreter)."""
    check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)
    num_reqs, num_rows, dim = src_slots.numel(), ckpt.shape[1], ckpt.shape[2]
    if num_reqs == 0 or num_rows == 0:
        return ckpt
    block_r, block_d = _block_sizes(num_rows, dim)
    grid = (triton.cdiv(num_rows, block_r), num_reqs, triton.cdiv(dim, block_d))
    _gather_units_kernel[grid](
        pool, ckpt, src_slots.contiguous(), dst_slots.contiguous(),
        unit_layer.contiguous(), unit_index.contiguous(),
        num_rows, dim, pool.stride(0), pool.stride(1), pool.stride(2),
        ckpt.stride(0), ckpt.stride(1), BLOCK_R=block_r, BLOCK_D=block_d,
    )  # fmt: skip
    return ckpt


# ---------------------------------------------------------------- scatter: checkpoint -> pool


@triton.jit
def _scatter_units_kernel(
    ckpt_ptr, pool_ptr, src_slots_ptr, dst_slots_ptr, unit_pos_ptr,
    num_units_total, num_units, dim, pool_stride_l, pool_stride_s, pool_stride_u,
    ckpt_stride_c, ckpt_stride_r,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # grid: (blocks of flattened (l, u) units, requests B, column blocks)
    units = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N], index l * U + u
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    unit_ok = units < num_units_total
    col_ok = cols < dim
    src = tl.load(src_slots_ptr + tl.program_id(1)).to(tl.int64)
    dst = tl.load(dst_slots_ptr + tl.program_id(1)).to(tl.int64)
    pos = tl.load(unit_pos_ptr + units, mask=unit_ok, other=-1).to(tl.int64)
    src_off = src * ckpt_stride_c + pos * ckpt_stride_r  # [BLOCK_N]
    is_kept = (pos >= 0)[:, None] & col_ok[None, :]  # omitted units are zero-filled
    vals = tl.load(ckpt_ptr + src_off[:, None] + cols[None, :], mask=is_kept, other=0.0)
    units64 = units.to(tl.int64)
    layer, unit = units64 // num_units, units64 % num_units
    dst_off = layer * pool_stride_l + dst * pool_stride_s + unit * pool_stride_u  # [BLOCK_N]
    tl.store(pool_ptr + dst_off[:, None] + cols[None, :], vals, mask=unit_ok[:, None] & col_ok)


def scatter_units_triton(
    ckpt: Tensor, src_slots: Tensor, unit_pos: Tensor, pool: Tensor, dst_slots: Tensor
) -> Tensor:
    """Triton implementation of `scatter_units` (CUDA, or CPU under the Triton interpreter)."""
    check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots)
    num_reqs, dim = src_slots.numel(), pool.shape[3]
    num_layers, num_units = unit_pos.shape
    num_units_total = num_layers * num_units
    if num_reqs == 0 or num_units_total == 0:
        return pool
    if ckpt.shape[1] == 0:  # nothing retained; an empty ckpt may not even have a valid pointer
        pool[:, dst_slots.long()] = 0
        return pool
    block_n, block_d = _block_sizes(num_units_total, dim)
    grid = (triton.cdiv(num_units_total, block_n), num_reqs, triton.cdiv(dim, block_d))
    _scatter_units_kernel[grid](
        ckpt, pool, src_slots.contiguous(), dst_slots.contiguous(), unit_pos.contiguous(),
        num_units_total, num_units, dim, pool.stride(0), pool.stride(1), pool.stride(2),
        ckpt.stride(0), ckpt.stride(1), BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    return pool
