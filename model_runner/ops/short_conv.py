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
    """x: [n, C]; weight: [C, kernel]; state: [C, kernel - 1] -> (silu(out) [n, C], new state)."""
    ext = torch.cat([state.to(weight.dtype), x.to(weight.dtype).t()], dim=1)  # [C, k - 1 + n]
    out = F.conv1d(ext[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    new_state = ext[:, ext.shape[1] - state.shape[1] :]
    return F.silu(out).t().to(x.dtype), new_state.to(state.dtype)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [B, C]; states: [B, C, kernel - 1] -> ([B, C], new states)."""
    ext = torch.cat([states.to(weight.dtype), x.to(weight.dtype)[..., None]], dim=-1)
    out = (ext * weight).sum(dim=-1)
    return F.silu(out).to(x.dtype), ext[..., 1:].to(states.dtype)
