"""Checkpoint backend for CUDA (and strided) state: the Triton kernels of
``kernels/ragged_state/triton.py`` and ``kernels/int8_quant/triton.py``."""

from __future__ import annotations

import torch

from kernels.int8_quant import dequantize_int8, quantize_int8
from kernels.ragged_state import gather_units, scatter_units
from model_runner.checkpoints.backends.interface import CheckpointBackend


class TritonBackend(CheckpointBackend):
    """CUDA state through the Triton kernels; strided CPU state through their torch
    references (the same dispatchers).  The reference the other backends equal bit for bit."""

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
