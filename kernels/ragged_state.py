"""Ragged gather / scatter of recurrent-state units between the active pool and checkpoints.

Buffers (one tensor-parallel rank):
- pool `[L, S, U, D]`: active FP32 state of all linear layers viewed per unit. GDN: `temporal`
  `[L, S, H, K, V]` viewed as `[L, S, H, K*V]` (a unit is a head); KDA: viewed as
  `[L, S, H*K, V]` (a unit is one key channel of one head).
- ckpt `[C, R, D]`: checkpoint slots. Layer l's retained units occupy rows `[o_l, o_l + r_l)`;
  ragged: `o_{l+1} = o_l + r_l`, `R = sum_l r_l`; padded: `o_l = l * R_max`, `R = L * R_max`, and
  rows `[o_l + r_l, o_l + R_max)` are padding.
- index tensors (int32): `unit_layer[R]`, `unit_index[R]` name the pool unit held by each row
  (-1 on padding rows); `unit_pos[L, U]` names the row of each pool unit (-1 if omitted).

Each operation has a torch reference (`*_ref`), a Triton kernel (`*_triton`) and a dispatcher that
uses Triton for CUDA tensors and the reference otherwise. The checkpoint pool's CPU path computes
the same results with the flat-row functions of `ragged_state_cpu.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor
LAYOUTS = ("ragged", "padded")


class UnitIndex(NamedTuple):
    """Index tensors describing where each retained unit lives in a checkpoint slot."""

    unit_layer: Tensor  # [R] int32, layer of the unit in row r, -1 on padding rows
    unit_index: Tensor  # [R] int32, unit within its layer, -1 on padding rows
    unit_pos: Tensor  # [L, U] int32, checkpoint row of unit (l, u), -1 if omitted
    offsets: list[int]  # o_l: first row of layer l
    num_rows: int  # R: rows per checkpoint slot


def layer_offsets(retained_counts: list[int], layout: str = "ragged") -> tuple[list[int], int]:
    """First row `o_l` of every layer and the rows per checkpoint slot, for `layout`."""
    if layout == "ragged":
        offsets, row = [], 0
        for count in retained_counts:
            offsets.append(row)
            row += count
        return offsets, row
    if layout == "padded":
        row_max = max(retained_counts, default=0)
        return [l * row_max for l in range(len(retained_counts))], len(retained_counts) * row_max
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def build_unit_index(
    masks: list[Tensor], layout: str = "ragged", device: torch.device | str | None = None
) -> UnitIndex:
    """Index tensors for retaining, per layer l, the units where `masks[l]` (`[U]` bool) is set.

    Retained units of a layer are stored in ascending unit order starting at row `o_l`.
    """
    if not masks:
        raise ValueError("need at least one layer mask")
    num_units = masks[0].numel()
    if any(m.dim() != 1 or m.numel() != num_units or m.dtype != torch.bool for m in masks):
        raise ValueError("masks must be 1-D bool tensors of one common length U")
    kept = [torch.nonzero(m.cpu()).flatten().to(torch.int32) for m in masks]  # [r_l] each
    offsets, num_rows = layer_offsets([k.numel() for k in kept], layout)
    unit_layer = torch.full((num_rows,), -1, dtype=torch.int32)
    unit_index = torch.full((num_rows,), -1, dtype=torch.int32)
    unit_pos = torch.full((len(masks), num_units), -1, dtype=torch.int32)
    for layer, (units, start) in enumerate(zip(kept, offsets, strict=True)):
        rows = torch.arange(start, start + units.numel(), dtype=torch.int32)  # [r_l]
        unit_layer[rows.long()] = layer
        unit_index[rows.long()] = units
        unit_pos[layer, units.long()] = rows
    return UnitIndex(
        unit_layer.to(device), unit_index.to(device), unit_pos.to(device), offsets, num_rows
    )


def _check_buffers(pool: Tensor, ckpt: Tensor) -> None:
    if pool.dim() != 4 or ckpt.dim() != 3:
        raise ValueError(
            f"want pool [L, S, U, D] and ckpt [C, R, D], got {pool.shape} {ckpt.shape}"
        )
    if pool.shape[3] != ckpt.shape[2] or pool.dtype != ckpt.dtype:
        raise ValueError("pool and ckpt must share the unit size D and the dtype")
    if pool.stride(3) != 1 or ckpt.stride(2) != 1:
        raise ValueError("the unit dimension D must be contiguous")


def _check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots) -> None:
    _check_buffers(pool, ckpt)
    if unit_layer.shape != (ckpt.shape[1],) or unit_index.shape != unit_layer.shape:
        raise ValueError("unit_layer and unit_index must be [R], R = ckpt.shape[1]")
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError("src_slots and dst_slots must be [B]")


def _check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots) -> None:
    _check_buffers(pool, ckpt)
    if unit_pos.shape != (pool.shape[0], pool.shape[2]):
        raise ValueError("unit_pos must be [L, U] of the pool")
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError("src_slots and dst_slots must be [B]")


def _block_sizes(num_rows: int, dim: int) -> tuple[int, int]:
    # About 4096 elements per program; a row is split when D is large (GDN heads: K*V).
    block_d = min(triton.next_power_of_2(dim), 1024)
    block_r = min(triton.next_power_of_2(max(num_rows, 1)), max(1, 4096 // block_d))
    return block_r, block_d


# ---------------------------------------------------------------- gather: pool -> checkpoint


def gather_units_ref(
    pool: Tensor,
    src_slots: Tensor,
    unit_layer: Tensor,
    unit_index: Tensor,
    ckpt: Tensor,
    dst_slots: Tensor,
) -> Tensor:
    """Torch reference of `gather_units`."""
    _check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)
    is_unit = unit_layer >= 0  # [R]
    layer = unit_layer.long().clamp(min=0)[None, :]  # [1, R]
    unit = unit_index.long().clamp(min=0)[None, :]  # [1, R]
    rows = pool[layer, src_slots.long()[:, None], unit]  # [B, R, D]
    ckpt[dst_slots.long()] = torch.where(is_unit[None, :, None], rows, 0)
    return ckpt


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


def gather_units_triton(
    pool: Tensor,
    src_slots: Tensor,
    unit_layer: Tensor,
    unit_index: Tensor,
    ckpt: Tensor,
    dst_slots: Tensor,
) -> Tensor:
    """Triton implementation of `gather_units` (CUDA, or CPU under the Triton interpreter)."""
    _check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)
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


def gather_units(
    pool: Tensor,
    src_slots: Tensor,
    unit_layer: Tensor,
    unit_index: Tensor,
    ckpt: Tensor,
    dst_slots: Tensor,
) -> Tensor:
    """Copy retained units of B active slots into B checkpoint slots; returns `ckpt`.

    pool `[L, S, U, D]`, ckpt `[C, R, D]` (same dtype), src_slots / dst_slots `[B]` int,
    unit_layer / unit_index `[R]` int32. For every b, r:
    `ckpt[dst_slots[b], r] = pool[unit_layer[r], src_slots[b], unit_index[r]]`, and zero on
    padding rows (`unit_layer[r] < 0`). dst_slots must be distinct.
    """
    fn = gather_units_triton if pool.is_cuda else gather_units_ref
    return fn(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)


# ---------------------------------------------------------------- scatter: checkpoint -> pool


def scatter_units_ref(
    ckpt: Tensor, src_slots: Tensor, unit_pos: Tensor, pool: Tensor, dst_slots: Tensor
) -> Tensor:
    """Torch reference of `scatter_units`."""
    _check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots)
    num_reqs, dim = src_slots.numel(), ckpt.shape[2]
    pos = unit_pos.long()  # [L, U]
    if ckpt.shape[1] == 0:  # nothing retained anywhere
        rows = pool.new_zeros(num_reqs, *pos.shape, dim)  # [B, L, U, D]
    else:
        rows = ckpt[src_slots.long()[:, None, None], pos.clamp(min=0)[None]]  # [B, L, U, D]
        rows = torch.where((pos >= 0)[None, :, :, None], rows, 0)
    pool[:, dst_slots.long()] = rows.transpose(0, 1)  # [L, B, U, D]
    return pool


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
    _check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots)
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


def scatter_units(
    ckpt: Tensor, src_slots: Tensor, unit_pos: Tensor, pool: Tensor, dst_slots: Tensor
) -> Tensor:
    """Restore B checkpoint slots into B active slots, zero-filling omitted units; returns `pool`.

    ckpt `[C, R, D]`, pool `[L, S, U, D]` (same dtype), src_slots / dst_slots `[B]` int,
    unit_pos `[L, U]` int32. For every b, l, u:
    `pool[l, dst_slots[b], u] = ckpt[src_slots[b], unit_pos[l, u]]` if `unit_pos[l, u] >= 0`
    else 0 (dasc-nr load). dst_slots must be distinct.
    """
    fn = scatter_units_triton if pool.is_cuda else scatter_units_ref
    return fn(ckpt, src_slots, unit_pos, pool, dst_slots)
