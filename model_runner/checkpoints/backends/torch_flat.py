"""Checkpoint backend for contiguous CPU state in plain torch: the flat-row gathers and block
writes of ``kernels/ragged_state/flat_rows.py``."""

from __future__ import annotations

import torch

from kernels.int8_quant import dequantize_int8
from kernels.ragged_state.flat_rows import (
    load_rows,
    put_rows,
    put_units,
    slot_blocks,
    stage_units,
    take_rows,
)
from model_runner.checkpoints.backends.interface import CheckpointBackend


class TorchFlatBackend(CheckpointBackend):
    """Contiguous CPU state in torch, when the C library is not built (no compiler, or
    ``DASC_NATIVE_KERNELS=0``): one flat row gather and one block write per buffer."""

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
