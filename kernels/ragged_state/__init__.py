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

Modules, one implementation each, all equal to the reference bit for bit:
    layout     UnitIndex, build_unit_index: where each retained unit lives; argument checks
    naive      torch reference (`*_ref`)
    triton     Triton kernels (`*_triton`), CUDA or the Triton interpreter
    flat_rows  torch CPU fast path: flat int64 row numbers, one gather and one write per buffer
    native     one-pass CPU path through the C library `native.c` (runs, ctypes, INT8 inline)
This module's `gather_units` / `scatter_units` use Triton for CUDA tensors, the reference
otherwise; the checkpoint pool picks among all paths itself (`model_runner/checkpoints/`).
"""

from __future__ import annotations

import torch

from kernels.ragged_state.layout import LAYOUTS, UnitIndex, build_unit_index, layer_offsets
from kernels.ragged_state.naive import gather_units_ref, scatter_units_ref
from kernels.ragged_state.triton import gather_units_triton, scatter_units_triton

__all__ = ["LAYOUTS", "UnitIndex", "build_unit_index", "gather_units", "layer_offsets",
           "scatter_units"]

Tensor = torch.Tensor


def gather_units(pool: Tensor, src_slots: Tensor, unit_layer: Tensor, unit_index: Tensor,
                 ckpt: Tensor, dst_slots: Tensor) -> Tensor:
    """Copy retained units of B active slots into B checkpoint slots; returns `ckpt`.

    pool `[L, S, U, D]`, ckpt `[C, R, D]` (same dtype), src_slots / dst_slots `[B]` int,
    unit_layer / unit_index `[R]` int32. For every b, r:
    `ckpt[dst_slots[b], r] = pool[unit_layer[r], src_slots[b], unit_index[r]]`, and zero on
    padding rows (`unit_layer[r] < 0`). dst_slots must be distinct.
    """
    fn = gather_units_triton if pool.is_cuda else gather_units_ref
    return fn(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)


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
