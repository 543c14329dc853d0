"""Where each retained unit lives in a checkpoint slot, and the argument checks every
implementation of the ragged gather / scatter runs (buffers: this package's docstring)."""

from __future__ import annotations

from typing import NamedTuple

import torch

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


def check_gather_args(pool, src_slots, unit_layer, unit_index, ckpt, dst_slots) -> None:
    _check_buffers(pool, ckpt)
    if unit_layer.shape != (ckpt.shape[1],) or unit_index.shape != unit_layer.shape:
        raise ValueError("unit_layer and unit_index must be [R], R = ckpt.shape[1]")
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError("src_slots and dst_slots must be [B]")


def check_scatter_args(ckpt, src_slots, unit_pos, pool, dst_slots) -> None:
    _check_buffers(pool, ckpt)
    if unit_pos.shape != (pool.shape[0], pool.shape[2]):
        raise ValueError("unit_pos must be [L, U] of the pool")
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError("src_slots and dst_slots must be [B]")
