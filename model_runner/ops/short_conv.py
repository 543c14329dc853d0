"""Depthwise causal short convolution with a carried state of (kernel - 1) positions.

For a sequence, ``ext = [state ; x]`` ([kernel - 1 + n, C]); output t is
``sum_j w[:, j] * ext[t + j]`` and the new state is the last (kernel - 1) rows of ``ext``, so a
zero state reproduces the zero-padded convolution of a fresh sequence.  SiLU follows.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [n, C]; weight [C, kernel]; state [C, kernel - 1] -> (silu(out) [n, C],
    new state); ``conv_varlen`` with a single sequence."""
    out, states, _ = conv_varlen(x, weight, state[None], [0, x.shape[0]])
    return out, states[0]


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                cu_seqlens: list[int], cuts: list[tuple[int, int]] = ()
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``conv_prefill`` of packed sequences in one pass: sequence i is rows
    [cu_seqlens[i], cu_seqlens[i + 1]) of x [N, C], its state ``states[i]`` [C, kernel - 1].
    Returns (silu(out) [N, C], new states [B, C, kernel - 1], and for each ``(i, n)`` of
    ``cuts`` the state sequence i has after its first n tokens [len(cuts), C, kernel - 1]).

    Every sequence's ``[state ; x]`` sits in one buffer and the window sum runs over all of it as
    ``kernel`` shifted slices, token-major and accumulated in FP32 (a grouped ``F.conv1d`` with
    thousands of one-channel groups runs per channel on CPU); the sum is rounded to the weight
    dtype before the SiLU, where transformers' conv rounds it.  The states are copies of rows,
    bit for bit what a split prefill leaves."""
    width, channels = states.shape[2], x.shape[1]
    state_rows, x_rows, final_rows = _conv_layout(tuple(cu_seqlens), width, x.device)
    ext = x.new_empty(cu_seqlens[-1] + len(states) * width, channels, dtype=torch.float32)
    ext[state_rows.view(-1)] = states.transpose(1, 2).reshape(-1, channels).float()
    ext[x_rows] = x.float()
    # row r of the window sum reads ext[r : r + kernel]: token t's output is row x_rows[t] - width;
    # the few rows that start inside a state are computed and dropped
    span, w = ext.shape[0] - width, weight.float()
    out = ext[:span] * w[:, 0]
    for j in range(1, width + 1):
        out.addcmul_(ext[j : j + span], w[:, j])
    if len(states) > 1:
        out = out[x_rows - width]

    def states_at(rows: torch.Tensor) -> torch.Tensor:  # [S, width] -> [S, C, width]
        return ext[rows].transpose(1, 2).to(states.dtype)

    cut_rows = state_rows[[i for i, _ in cuts]] + torch.tensor(
        [n for _, n in cuts], dtype=torch.long, device=x.device).view(-1, 1)
    return (F.silu(out.to(weight.dtype)).to(x.dtype), states_at(final_rows),
            states_at(cut_rows))


@lru_cache(maxsize=16)
def _conv_layout(cu_seqlens: tuple[int, ...], width: int, device: torch.device
                 ) -> tuple[torch.Tensor, ...]:
    """Rows of ``conv_varlen``'s buffer, sequence i's ``[state ; x]`` after sequence i - 1's:
    (its state rows [B, width], the tokens' rows [N], the rows of each sequence's last
    ``width`` entries [B, width])."""
    num_seqs = len(cu_seqlens) - 1
    lens = torch.tensor(cu_seqlens[1:]) - torch.tensor(cu_seqlens[:-1])
    base = torch.tensor(cu_seqlens[:-1]) + torch.arange(num_seqs) * width
    seq = torch.repeat_interleave(torch.arange(num_seqs), lens)
    x_rows = base[seq] + width + torch.arange(cu_seqlens[-1]) - torch.tensor(cu_seqlens[:-1])[seq]
    offsets = torch.arange(width)
    rows = base[:, None] + offsets, x_rows, (base + lens)[:, None] + offsets
    return tuple(t.to(device) for t in rows)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [B, C]; states: [B, C, kernel - 1] -> ([B, C], new states)."""
    ext = torch.cat([states.float(), x.float()[..., None]], dim=-1)
    out = (ext * weight.float()).sum(dim=-1)
    return F.silu(out.to(weight.dtype)).to(x.dtype), ext[..., 1:].to(states.dtype)
