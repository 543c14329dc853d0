"""Depthwise causal short convolution with a carried state of (kernel - 1) positions.

For a sequence, ``ext = [state ; x]`` ([kernel - 1 + n, C]); output t is
``sum_j w[:, j] * ext[t + j]`` and the new state is the last (kernel - 1) rows of ``ext``, so a
zero state reproduces the zero-padded convolution of a fresh sequence.  SiLU follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, C]; weight: [C, kernel]; state: [C, kernel - 1] -> (silu(out) [n, C], new state).

    Token-major, accumulated in FP32: ``kernel`` multiply-adds over [n, C] (a grouped
    ``F.conv1d`` with thousands of one-channel groups runs per channel on CPU).  The sum is
    rounded to the weight dtype before the SiLU, where transformers' conv rounds it."""
    n, width = x.shape[0], state.shape[1]
    ext = torch.cat([state.t().float(), x.float()])  # [k - 1 + n, C]
    w = weight.float()
    out = ext[:n] * w[:, 0]
    for j in range(1, width + 1):
        out.addcmul_(ext[j : j + n], w[:, j])
    return F.silu(out.to(weight.dtype)).to(x.dtype), ext[n:].t().to(state.dtype)


def conv_state_after(x: torch.Tensor, state: torch.Tensor, n: int) -> torch.Tensor:
    """The state ``conv_prefill(x[:n], ..., state)`` would leave, bit for bit: the last
    (kernel - 1) rows of ``[state ; x[:n]]``."""
    width = state.shape[1]
    ext = torch.cat([state.t().float(), x[max(0, n - width) : n].float()])
    return ext[ext.shape[0] - width :].t().to(state.dtype)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [B, C]; states: [B, C, kernel - 1] -> ([B, C], new states)."""
    ext = torch.cat([states.float(), x.float()[..., None]], dim=-1)
    out = (ext * weight.float()).sum(dim=-1)
    return F.silu(out.to(weight.dtype)).to(x.dtype), ext[..., 1:].to(states.dtype)
