"""Checkpoint backend for contiguous CPU state through the C library
(``kernels/ragged_state/native.py`` over ``native.c``)."""

from __future__ import annotations

import torch

from kernels.ragged_state.native import (
    check_slots,
    conv_runs,
    copy_runs,
    dequantize_runs,
    quantize_runs,
)
from model_runner.checkpoints.backends.interface import CheckpointBackend


class NativeBackend(CheckpointBackend):
    """Contiguous CPU state through the C library: one pass per buffer over runs the pool
    precomputed once (``ckpt.runs``), so every byte moves once; INT8 inside the copy."""

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
