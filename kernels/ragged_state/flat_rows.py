"""CPU fast path of checkpoint store/load: flat int64 row numbers, one gather and one write.

torch gathers rows fast on CPU (`index_select` copies each row of a contiguous source with one
memcpy into a sequential output), but its indexed writes (`index_copy_`, `index_put_`) go element
by element; written as 16-byte elements, whole blocks still move near memcpy speed. So:
- store: one flat row gather (pool -> staging `[B, R, D]`, `stage_units`) plus one write of whole
  checkpoint slots (`put_rows`);
- load: one flat row gather (checkpoint -> staging `[L, B, U, D]` in pool order, omitted units
  reading a zero row kept in front of the checkpoint rows, `load_rows`) plus one write of whole
  (layer, slot) blocks (`put_units`). When at most a quarter of the units are retained
  (`FlatIndex.is_sparse`), a load instead zero-fills those blocks, gathers only the stored rows
  and writes them row by row, which moves fewer rows in all.
Buffers and layouts are this package's; results equal `naive.py`'s `gather_units_ref` /
`scatter_units_ref` bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels.ragged_state.layout import UnitIndex

Tensor = torch.Tensor


@dataclass(slots=True)
class FlatIndex:
    """A `UnitIndex` as int64 row numbers; built once per checkpoint pool.

    A row is a group of g consecutive units, `g * D` wide: g > 1 when every run of retained
    units, every run of padding rows and every layer offset is a multiple of g (dense plans:
    g = U), so fewer, longer rows move. Pool `[L, S, U, D]` (contiguous): group j of (l, s) is
    row `(l * S + s) * U / g + j` of `pool.view(-1, g * D)`. Checkpoint rows `[g + C * R, D]`
    viewed `[1 + C * R / g, g * D]`: row 0 is zero, group r of slot c is row `1 + c * R / g + r`.
    """

    group: int  # g: units per row
    row_layer: Tensor  # [R / g] layer of the units in slot row group r (0 on padding)
    row_unit: Tensor  # [R / g] their first unit / g (0 on padding)
    pad_rows: Tensor  # [P / g] padding row groups of a slot
    real_rows: Tensor  # [R' / g] the row groups of a slot that hold units
    unit_row: Tensor  # [L, 1, U / g] 1 + slot row group of unit group (l, j); 0 if omitted
    unit_mask: Tensor  # [L, 1, U / g] all bits set if unit group (l, j) is retained, else 0
    num_rows: int  # R / g
    is_sparse: bool  # at most a quarter of the pool's units retained
    _active: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, index: UnitIndex) -> FlatIndex:
        g = _group_size(index)
        layer, pos = index.unit_layer[::g].long(), index.unit_pos[:, ::g].long()
        return cls(g, layer.clamp(min=0), index.unit_index[::g].long().clamp(min=0) // g,
                   torch.nonzero(layer < 0).flatten(), torch.nonzero(layer >= 0).flatten(),
                   (pos // g + 1)[:, None], -(pos >= 0).long()[:, None], index.num_rows // g,
                   4 * int((pos >= 0).sum()) <= pos.numel())  # fmt: skip

    def active(self, num_slots: int) -> tuple[Tensor, Tensor]:
        """For an active pool of S = num_slots slots (cached): pool rows `[R / g]` of slot row
        group r in active slot 0, and the first block row `l * S` of every layer `[L]`."""
        if num_slots not in self._active:
            num_layers, num_groups = self.unit_row.shape[0], self.unit_row.shape[2]
            self._active[num_slots] = (
                self.row_layer * (num_slots * num_groups) + self.row_unit,
                torch.arange(0, num_layers * num_slots, num_slots, device=self.row_unit.device),
            )
        return self._active[num_slots]


def _group_size(index: UnitIndex) -> int:
    """Largest g dividing U, R, every run start (checkpoint row and unit) and run length."""
    layers, units = index.unit_layer.tolist(), index.unit_index.tolist()
    g = math.gcd(index.unit_pos.shape[1], index.num_rows, max(units[0], 0) if units else 0)
    for r in range(1, index.num_rows):
        same_run = layers[r] == layers[r - 1] and (layers[r] < 0 or units[r] == units[r - 1] + 1)
        if not same_run:
            g = math.gcd(g, r, max(units[r], 0))
    return max(g, 1)


def take_rows(src: Tensor, rows: Tensor, out: Tensor | None = None) -> Tensor:
    """`src[rows]` for a contiguous src `[N, W]` and int64 rows `[M]`: `[M, W]` (into a
    contiguous `out` of that many elements if given), one pass."""
    if out is None:
        out = src.new_empty(rows.numel(), src.shape[1])
    if src.shape[1] == 1:  # torch's 1-D gather beats one memcpy per 1-element row
        torch.index_select(src.view(-1), 0, rows, out=out.view(-1))
    else:
        torch.index_select(src, 0, rows, out=out.view(rows.numel(), src.shape[1]))
    return out


def put_rows(dst: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """`dst[index] = src` for 2-D dst `[N, W]` and src `[M, W]` (one dtype, rows contiguous),
    distinct int64 index `[M]`; written through the widest dtype view of the rows. Returns dst."""
    if src.numel():
        nbytes = math.gcd(dst.shape[1], dst.stride(0), dst.storage_offset(), src.stride(0),
                          src.storage_offset()) * dst.element_size()
        wide = _wide_dtype(dst, nbytes) if dst.stride(1) == src.stride(1) == 1 else dst.dtype
        dst.view(wide).index_put_((index,), src.view(wide))
    return dst


def _wide_dtype(t: Tensor, nbytes: int) -> torch.dtype:
    """The widest dtype, no narrower than t's, whose size divides nbytes."""
    for wide in (torch.complex128, torch.int64, torch.int32, torch.int16):
        if t.element_size() <= wide.itemsize and nbytes % wide.itemsize == 0:
            return wide
    return t.dtype


def slot_blocks(slots: Tensor, layer_starts: Tensor, slot_major: bool) -> Tensor:
    """Rows `layer_starts[l] + slots[b]` of a `[L * S, ...]` view (layer_starts = `l * S`),
    ordered (b, l) if slot_major else (l, b)."""
    if slot_major:
        return torch.add(slots.long()[:, None], layer_starts).view(-1)
    return torch.add(slots.long(), layer_starts[:, None]).view(-1)


def stage_units(pool: Tensor, src_slots: Tensor, flat: FlatIndex,
                out: Tensor | None = None) -> Tensor:
    """Retained units of active slots src_slots `[B]` as checkpoint slot rows `[B, R, D]`
    (padding rows zero; into a contiguous `out` if given). pool `[L, S, U, D]` contiguous."""
    width = flat.group * pool.shape[3]
    pool_rows = flat.active(pool.shape[1])[0]
    rows = torch.add(pool_rows, src_slots.long()[:, None], alpha=flat.unit_row.shape[2])
    staged = take_rows(pool.view(-1, width), rows.view(-1), out).view(*rows.shape, width)
    if flat.pad_rows.numel():
        wide = _wide_dtype(staged, width * staged.element_size())
        staged.view(wide).index_fill_(1, flat.pad_rows, 0)
    return staged.view(rows.shape[0], -1, pool.shape[3])


def load_rows(flat: FlatIndex, src_slots: Tensor) -> Tensor:
    """Rows of checkpoint rows viewed `[1 + C * R / g, g * D]` that a load of checkpoint slots
    src_slots `[B]` gathers, in the order `put_units` writes them: sparse plans the retained
    row groups of each slot `[B * R' / g]`; else all unit groups in pool order (l, b, j)
    `[L * B * U / g]`, 0 (the zero row) for omitted ones."""
    if flat.is_sparse:
        rows = torch.add(flat.real_rows + 1, src_slots.long()[:, None], alpha=flat.num_rows)
        return rows.view(-1)  # [B * R' / g]
    offsets = (src_slots.long() * flat.num_rows)[None, :, None]  # [1, B, 1]
    # omitted: unit_row = 0 and mask = 0, so the sum is masked back to 0 (no int64 multiply)
    return torch.add(flat.unit_row, offsets).bitwise_and_(flat.unit_mask).view(-1)


def put_units(pool: Tensor, dst_slots: Tensor, staged: Tensor, flat: FlatIndex) -> Tensor:
    """Write rows gathered along `load_rows` (staged `[M, g * D]`) into active slots dst_slots
    of a contiguous pool `[L, S, U, D]`, omitted units zero. Returns pool."""
    pool_rows, layer_starts = flat.active(pool.shape[1])
    blocks = slot_blocks(dst_slots, layer_starts, slot_major=False)  # [L * B]
    block_rows = pool.view(-1, pool[0, 0].numel())  # [L * S, U * D]
    if not flat.is_sparse:
        put_rows(block_rows, blocks, staged.view(blocks.numel(), -1))
        return pool
    wide = _wide_dtype(block_rows, block_rows.shape[1] * block_rows.element_size())
    block_rows.view(wide).index_fill_(0, blocks, 0)
    if flat.pad_rows.numel():
        pool_rows = pool_rows.index_select(0, flat.real_rows)
    rows = torch.add(pool_rows, dst_slots.long()[:, None], alpha=flat.unit_row.shape[2])
    put_rows(pool.view(-1, staged.shape[1]), rows.view(-1), staged)
    return pool


class Scratch:
    """Named staging buffers reused across calls: a fresh multi-MB temporary costs page faults
    on every call (glibc hands large blocks back to the kernel), several times the copy."""

    def __init__(self, device: torch.device):
        self.device, self._buffers = device, {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A contiguous `[*shape]` view of buffer `name`, grown when too small."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)
