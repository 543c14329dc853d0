"""The three ways a ``CheckpointPool`` moves state, one class each; the pool picks one per call.

- ``KernelPath``: CUDA (the Triton kernels of ``kernels/ragged_state.py`` and
  ``kernels/int8_quant.py``) and any strided state; the reference the others equal bit for bit.
- ``NativePath``: contiguous CPU state through the C library (``kernels/state_copy.py``): one
  pass per buffer over runs precomputed once, so every byte moves once.
- ``FlatPath``: contiguous CPU state without the library (no compiler, or
  ``DASC_NATIVE_KERNELS=0``): one flat row gather and one block write per buffer
  (``kernels/ragged_state_cpu.py``).

Every path takes the same arguments: the active state seen per unit, pool [L, S, U_loc, D]
fp32, the active conv state [L, S, conv_dim_loc, k-1], and slot ids src [B] -> dst [B]
(checked by the pool).  With a balancing placement store and load are collectives.  Each path
holds the ``CheckpointPool`` it serves (``ckpt``: its buffers, index, runs and balance helpers;
not imported here, which would make the two modules import each other).
"""

from __future__ import annotations

import torch

from kernels.int8_quant import dequantize_int8, quantize_int8
from kernels.ragged_state import gather_units, scatter_units
from kernels.ragged_state_cpu import (
    load_rows,
    put_rows,
    put_units,
    slot_blocks,
    stage_units,
    take_rows,
)
from kernels.state_copy import (
    check_slots,
    conv_runs,
    copy_runs,
    dequantize_runs,
    quantize_runs,
)


class KernelPath:
    def __init__(self, ckpt):
        self.ckpt = ckpt

    def store(self, pool, conv, src, dst) -> None:
        c, idx = self.ckpt, self.ckpt.index
        c.conv[:, dst] = conv[:, src].to(c.conv.dtype)
        if c.balance is None and c.scale is None:
            gather_units(pool, src, idx.unit_layer, idx.unit_index, c.temporal, dst)
            return
        num_reqs = src.numel()
        packed = pool.new_empty(num_reqs, idx.num_rows, c.unit_dim)  # [B, R, D] fp32
        gather_units(pool, src, idx.unit_layer, idx.unit_index, packed,
                     torch.arange(num_reqs, device=c.device))
        if c.scale is None:
            c.temporal[dst] = c.balance_out(packed)
            return
        q, s = quantize_int8(packed.view(num_reqs, idx.num_rows, *c.unit_rows))
        q = q.view(num_reqs, idx.num_rows, c.unit_dim)  # [B, R, D] int8; s [B, R, rpu]
        c.temporal[dst], c.scale[dst] = c.balance_int8_out(q, s)

    def load(self, pool, conv, src, dst) -> None:
        c, idx = self.ckpt, self.ckpt.index
        conv[:, dst] = c.conv[:, src].to(conv.dtype)
        if c.balance is None and c.scale is None:
            scatter_units(c.temporal, src, idx.unit_pos, pool, dst)
            return
        num_reqs = src.numel()
        if c.scale is None:
            packed = c.balance_in(c.temporal[src])  # [B, R, D]
        else:
            q, s = c.balance_int8_in(c.temporal[src], c.scale[src])
            q = q.view(num_reqs, idx.num_rows, *c.unit_rows)  # [B, R, rpu, V]
            packed = dequantize_int8(q, s).view(num_reqs, idx.num_rows, c.unit_dim)
        scatter_units(packed, torch.arange(num_reqs, device=c.device), idx.unit_pos, pool, dst)


class NativePath:
    def __init__(self, ckpt):
        self.ckpt = ckpt

    def store(self, pool, conv, src, dst) -> None:
        c = self.ckpt
        num_slots, slot_floats = pool.shape[1], pool.stride(1)
        src = check_slots(src, num_slots, "active")
        dst = check_slots(dst, c.num_slots, "checkpoint")
        self._copy_conv(conv, src, dst, store=True)
        if c.scale is not None and c.balance is None:
            quantize_runs(pool, c.temporal, c.scale, src, dst, slot_floats,
                          c.runs.int8(num_slots)[0], *c.unit_rows)
            return
        runs = c.runs.fp32(num_slots)[0]
        if c.balance is None:
            copy_runs(pool, c.temporal, src, dst, slot_floats * 4, c.slot_bytes, runs)
            return
        num_reqs = src.numel()  # pack [B, R, D] fp32, then balance (and quantise)
        packed = c.scratch.get("units_out", (num_reqs, c.index.num_rows, c.unit_dim),
                               torch.float32)
        copy_runs(pool, packed, src, torch.arange(num_reqs), slot_floats * 4,
                  packed.stride(0) * 4, runs)
        c.store_packed(packed, dst)

    def load(self, pool, conv, src, dst) -> None:
        c = self.ckpt
        num_slots, slot_floats = pool.shape[1], pool.stride(1)
        src = check_slots(src, c.num_slots, "checkpoint")
        dst = check_slots(dst, num_slots, "active")
        self._copy_conv(conv, src, dst, store=False)
        if c.scale is not None and c.balance is None:
            dequantize_runs(c.temporal, c.scale, pool, src, dst, slot_floats,
                            c.runs.int8(num_slots)[1], *c.unit_rows)
            return
        runs = c.runs.fp32(num_slots)[1]
        if c.balance is None:
            copy_runs(c.temporal, pool, src, dst, c.slot_bytes, slot_floats * 4, runs)
            return
        packed = c.unbalance(src)[c.flat.group:]  # collective; fp32 [B * R, D]
        copy_runs(packed, pool, torch.arange(src.numel()), dst,
                  c.index.num_rows * c.unit_dim * 4, slot_floats * 4, runs)

    def _copy_conv(self, conv, src, dst, store: bool) -> None:
        c = self.ckpt
        slots = c.conv_slots  # [N, L, C, k-1]
        if conv.dtype != slots.dtype:  # a conversion, not a copy: torch's
            if store:
                c.conv[:, dst] = conv[:, src].to(slots.dtype)
            else:
                conv[:, dst] = c.conv[:, src].to(conv.dtype)
            return
        block = conv.stride(1) * conv.element_size()  # one layer of one slot
        to_ckpt, to_pool = conv_runs(conv.shape[0], conv.shape[1], block)
        if store:
            copy_runs(conv, slots, src, dst, block, conv.shape[0] * block, to_ckpt)
        else:
            copy_runs(slots, conv, src, dst, conv.shape[0] * block, block, to_pool)


class FlatPath:
    def __init__(self, ckpt):
        self.ckpt = ckpt

    def store(self, pool, conv, src, dst) -> None:
        c, buffer = self.ckpt, self.ckpt.scratch.get
        num_reqs = src.numel()
        layer_starts = c.flat.active(pool.shape[1])[1]
        conv_rows = conv.view(-1, conv.shape[2] * conv.shape[3])  # [L * S, conv]
        conv_out = take_rows(conv_rows, slot_blocks(src, layer_starts, slot_major=True),
                             buffer("conv_out", (num_reqs, c.conv_slots[0].numel()),
                                    conv.dtype))  # [B, L * conv]
        put_rows(c.conv_slots.flatten(1), dst, conv_out.to(c.conv.dtype))
        shape = (num_reqs, c.index.num_rows, c.unit_dim)  # [B, R, D]
        c.store_packed(stage_units(pool, src, c.flat, buffer("units_out", shape, torch.float32)),
                       dst)

    def load(self, pool, conv, src, dst) -> None:
        c, buffer = self.ckpt, self.ckpt.scratch.get
        num_reqs, width = src.numel(), c.flat.group * c.unit_dim
        layer_starts = c.flat.active(pool.shape[1])[1]
        conv_in = take_rows(c.conv_slots.flatten(1), src,
                            buffer("conv_in", (num_reqs, c.conv_slots[0].numel()),
                                   c.conv.dtype))  # [B, L * conv]
        conv_rows = conv.view(-1, conv.shape[2] * conv.shape[3])  # [L * S, conv]
        put_rows(conv_rows, slot_blocks(dst, layer_starts, slot_major=True),
                 conv_in.to(conv.dtype).view(-1, conv_rows.shape[1]))
        if c.balance is not None:  # a collective gives the packed fp32 rows
            rows = load_rows(c.flat, torch.arange(num_reqs))
            units = take_rows(c.unbalance(src).view(-1, width), rows)
        elif c.scale is None:  # gather straight from the checkpoint rows
            rows = load_rows(c.flat, src)
            units = take_rows(c.payload_rows.view(-1, width), rows,
                              buffer("units_in", (rows.numel(), width), torch.float32))
        else:  # the same gather in int8 with its scales, then dequantised
            rows = load_rows(c.flat, src)
            codes = take_rows(c.payload_rows.view(-1, width), rows,
                              buffer("units_in", (rows.numel(), width), torch.int8))
            codes = codes.view(-1, *c.unit_rows)  # [M * g, rpu, V]
            scales = take_rows(c.scale_rows.view(-1, width // c.unit_rows[1]), rows)
            units = dequantize_int8(codes, scales.view(codes.shape[:-1]),
                                    buffer("fp32", codes.shape, torch.float32))
        put_units(pool, dst, units.view(-1, width), c.flat)
