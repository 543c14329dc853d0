"""Torch reference of the ragged gather / scatter (buffers: this package's docstring): readable,
and what every fast path (`triton`, `flat_rows`, `native`) equals bit for bit."""

from __future__ import annotations

import torch

from kernels.ragged_state.layout import check_gather_args, check_scatter_args

Tensor = torch.Tensor


def gather_units_ref(pool: Tensor, src_slots: Tensor, unit_layer: Tensor, unit_index: Tensor,
                     ckpt: Tensor, dst_slots: Tensor) -> Tensor:
    """Torch reference of `gather_units`."""
    check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots)
    is_unit = unit_layer >= 0  # [R]
    layer = unit_layer.long().clamp(min=0)[None, :]  # [1, R]
    unit = unit_index.long().clamp(min=0)[None, :]  # [1, R]
    rows = pool[layer, src_slots.long()[:, None], unit]  # [B, R, D]
    ckpt[dst_slots.long()] = torch.where(is_unit[None, :, None], rows, 0)
    return ckpt


def scatter_units_ref(
    ckpt: Tensor, src_slots: Tensor, unit_pos: Tensor, pool: Tensor, dst_slots: Tensor
) -> Tensor:
    """Torch reference of `scatter_units`."""
    check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots)
    num_reqs, dim = src_slots.numel(), ckpt.shape[2]
    pos = unit_pos.long()  # [L, U]
    if ckpt.shape[1] == 0:  # nothing retained anywhere
        rows = pool.new_zeros(num_reqs, *pos.shape, dim)  # [B, L, U, D]
    else:
        rows = ckpt[src_slots.long()[:, None, None], pos.clamp(min=0)[None]]  # [B, L, U, D]
        rows = torch.where((pos >= 0)[None, :, :, None], rows, 0)
    pool[:, dst_slots.long()] = rows.transpose(0, 1)  # [L, B, U, D]
    return pool
