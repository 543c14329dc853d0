"""One-pass CPU checkpoint store/load: precomputed runs, one C call per buffer.

torch has no single-pass indexed copy on CPU (a gather then an indexed write moves every byte
twice, and rows of one 128-byte unit cost a call each), so the checkpoint pool's CPU path runs
`native.c` (beside this file): for each slot pair it walks a list of runs (source offset,
destination offset, length) that `StateRuns` derives once per pool from its `UnitIndex`, and
moves each with one memcpy (memset for omitted units), or quantises / dequantises it to INT8 on
the way. A dense plan is one run per layer; a W_max plan one run per stretch of consecutive
retained units, so a load's time falls with the stored bytes.

The library is compiled on first use (`kernels/native_build.py`); without a compiler, or with
`DASC_NATIVE_KERNELS=0`, `native_library()` is None and the pool uses the torch flat-row path
of `flat_rows.py`. The C code trusts its arguments: callers check slot ids (`check_slots`) and
buffer shapes first.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64 as _I64
from kernels.native_build import PTR as _PTR
from kernels.native_build import load_library
from kernels.ragged_state.layout import UnitIndex

Tensor = torch.Tensor
SOURCE = Path(__file__).with_name("native.c")
_SIGNATURES = {
    "dasc_copy_runs": (_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR),
    "dasc_quantize_runs": (_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                           _I64, _I64),
    "dasc_dequantize_runs": (_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                             _I64, _I64),
}


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled run-copy library, or None (disabled, no compiler, or the build failed:
    warned once) so callers fall back to torch."""
    return load_library(SOURCE, "ragged_state", _SIGNATURES, "CPU checkpoint kernels")


def check_slots(slots: Tensor, num_slots: int, what: str) -> Tensor:
    """slots as contiguous int64, every id in [0, num_slots) (the C code does not check)."""
    ids = slots.tolist()
    if ids and (min(ids) < 0 or max(ids) >= num_slots):
        raise IndexError(f"{what} slot ids {ids} outside [0, {num_slots})")
    return slots.to(torch.long).contiguous()


@dataclass(slots=True)
class StateRuns:
    """Runs between an active pool `[L, S, U, D]` (contiguous) and checkpoint slots `[R, D]`,
    built once per pool in units; `fp32(S)` and `int8(S)` give the int64 `[n, 3]` tensors the
    C code reads for a pool of S slots (cached).

    store: (pool unit (l, u) or layer -1 for padding rows, first checkpoint row, units)
    load:  (first checkpoint row or -1 for omitted units, pool unit (l, u), units)
    """

    store: list[tuple[int, int, int, int]]  # (layer or -1, unit, row, n)
    load: list[tuple[int, int, int, int]]  # (row or -1, layer, unit, n)
    num_units: int  # U
    unit_dim: int  # D
    _cache: dict[tuple[str, int], tuple[Tensor, Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, index: UnitIndex, unit_dim: int) -> StateRuns:
        store: list[tuple[int, int, int, int]] = []
        rows = zip(index.unit_layer.tolist(), index.unit_index.tolist(), strict=True)
        for row, (layer, unit) in enumerate(rows):
            prev = store[-1] if store else None
            if prev and prev[0] == layer and (layer < 0 or prev[1] + prev[3] == unit):
                store[-1] = (*prev[:3], prev[3] + 1)  # continues the previous run
            else:
                store.append((layer, unit, row, 1))
        load: list[tuple[int, int, int, int]] = []
        for layer, unit_rows in enumerate(index.unit_pos.tolist()):
            for unit, row in enumerate(unit_rows):
                prev = load[-1] if load else None
                if prev and prev[1] == layer and (prev[0] < 0 if row < 0
                                                  else prev[0] >= 0 and prev[0] + prev[3] == row):
                    load[-1] = (*prev[:3], prev[3] + 1)
                else:
                    load.append((row, layer, unit, 1))
        return cls(store, load, index.unit_pos.shape[1], unit_dim)

    def fp32(self, num_slots: int) -> tuple[Tensor, Tensor]:
        """(store, load) runs in bytes: pool byte offset, checkpoint byte offset, length."""
        unit = self.unit_dim * 4
        return self._runs("fp32", num_slots, lambda off: off * unit, lambda row: row * unit,
                          unit)

    def int8(self, num_slots: int) -> tuple[Tensor, Tensor]:
        """(store, load) runs for `quantize_runs` / `dequantize_runs`: pool float offset,
        checkpoint row, length in units."""
        return self._runs("int8", num_slots, lambda off: off * self.unit_dim, lambda row: row, 1)

    def _runs(self, kind, num_slots, pool_at, row_at, per_unit) -> tuple[Tensor, Tensor]:
        if (kind, num_slots) not in self._cache:
            def pool(layer: int, unit: int) -> int:
                return pool_at(layer * num_slots * self.num_units + unit)

            store = [(pool(l, u) if l >= 0 else -1, row_at(row), n * per_unit)
                     for l, u, row, n in self.store]
            load = [(row_at(row) if row >= 0 else -1, pool(l, u), n * per_unit)
                    for row, l, u, n in self.load]
            self._cache[kind, num_slots] = (torch.tensor(store, dtype=torch.long).view(-1, 3),
                                            torch.tensor(load, dtype=torch.long).view(-1, 3))
        return self._cache[kind, num_slots]


@cache
def conv_runs(num_layers: int, num_slots: int, block_bytes: int) -> tuple[Tensor, Tensor]:
    """(store, load) runs `[L, 3]` in bytes between a conv pool `[L, S, C, k-1]` and slot-major
    checkpoint conv `[N, L, C, k-1]`; block_bytes = C * (k-1) * element size."""
    store = torch.tensor([[l * num_slots * block_bytes, l * block_bytes, block_bytes]
                          for l in range(num_layers)], dtype=torch.long)
    return store, store[:, [1, 0, 2]].contiguous()


def copy_runs(src: Tensor, dst: Tensor, src_slots: Tensor, dst_slots: Tensor,
              src_stride: int, dst_stride: int, runs: Tensor) -> None:
    """For each b and run: bytes [src_slots[b] * src_stride + run.src, + run.len) of src ->
    dst_slots[b] * dst_stride + run.dst of dst (zeros when run.src < 0)."""
    native_library().dasc_copy_runs(
        src.data_ptr(), dst.data_ptr(), src_slots.numel(), src_slots.data_ptr(),
        dst_slots.data_ptr(), src_stride, dst_stride, runs.shape[0], runs.data_ptr())


def quantize_runs(src: Tensor, q: Tensor, scale: Tensor, src_slots: Tensor, dst_slots: Tensor,
                  src_stride: int, runs: Tensor, rows_per_unit: int, value_dim: int) -> None:
    """INT8 store: fp32 units of src (runs in floats / rows / units) -> checkpoint slots of
    q `[N, R, D]` int8 and scale `[N, R, D / V]`."""
    native_library().dasc_quantize_runs(
        src.data_ptr(), q.data_ptr(), scale.data_ptr(), src_slots.numel(), src_slots.data_ptr(),
        dst_slots.data_ptr(), src_stride, q.stride(0), scale.stride(0), runs.shape[0],
        runs.data_ptr(), rows_per_unit * value_dim, value_dim)


def dequantize_runs(q: Tensor, scale: Tensor, dst: Tensor, src_slots: Tensor,
                    dst_slots: Tensor, dst_stride: int, runs: Tensor, rows_per_unit: int,
                    value_dim: int) -> None:
    """INT8 load: checkpoint slots of q / scale (runs in rows / floats / units) -> fp32 dst,
    omitted units zero."""
    native_library().dasc_dequantize_runs(
        q.data_ptr(), scale.data_ptr(), dst.data_ptr(), src_slots.numel(), src_slots.data_ptr(),
        dst_slots.data_ptr(), q.stride(0), scale.stride(0), dst_stride, runs.shape[0],
        runs.data_ptr(), rows_per_unit * value_dim, value_dim)
