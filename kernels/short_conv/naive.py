"""Depthwise causal short convolution with a carried state of (kernel - 1) positions.

For a sequence, ``ext = [state ; x]`` ([kernel - 1 + n, C]); output t is
``sum_j w[:, j] * ext[t + j]`` and the new state is the last (kernel - 1) rows of ``ext``, so a
zero state reproduces the zero-padded convolution of a fresh sequence.  SiLU follows.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels.derived import derived
from kernels.short_conv.cpu import conv_in_place, conv_window_sums


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
    bit for bit what a split prefill leaves.  At inference on a CPU the window sums run as
    the C kernel (``cpu.py`` beside this file) where it is built (the same sums, straight from x
    and the states, no buffer), and the states are cut from x and the old states."""
    width, channels = states.shape[2], x.shape[1]
    sums = conv_window_sums(x, _columns(weight), states, cu_seqlens, weight.dtype) \
        if x.is_cpu else None
    if sums is not None:
        finals = [_state_after(x, states[i], a, b) for i, (a, b) in
                  enumerate(zip(cu_seqlens, cu_seqlens[1:]))]
        at_cuts = [_state_after(x, states[i], cu_seqlens[i], cu_seqlens[i] + n) for i, n in cuts]
        return (F.silu(sums).to(x.dtype), _stack(finals, states),
                _stack(at_cuts, states))
    state_rows, x_rows, final_rows = _conv_layout(tuple(cu_seqlens), width, x.device)
    ext = x.new_empty(cu_seqlens[-1] + len(states) * width, channels, dtype=torch.float32)
    for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):  # slices: an index_put of a
        start = a + i * width  # 1,024-token chunk's rows cost 16 ms at 8,192 channels, 8x these
        ext[start : start + width] = states[i].t()
        ext[start + width : b + (i + 1) * width] = x[a:b]
    # row r of the window sum reads ext[r : r + kernel]: token t's output is row x_rows[t] - width;
    # the few rows that start inside a state are computed and dropped
    span = ext.shape[0] - width
    out = _window_sum([ext[j : j + span] for j in range(width + 1)], weight)
    if len(states) > 1:
        out = out[x_rows - width]

    def states_at(rows: torch.Tensor) -> torch.Tensor:  # [S, width] -> [S, C, width]
        return ext[rows].transpose(1, 2).to(states.dtype)

    cut_rows = state_rows[[i for i, _ in cuts]] + torch.tensor(
        [n for _, n in cuts], dtype=torch.long, device=x.device).view(-1, 1)
    return (F.silu(out.to(weight.dtype)).to(x.dtype), states_at(final_rows),
            states_at(cut_rows))


def _state_after(x: torch.Tensor, state: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The state [C, width] after tokens x[a:b] follow ``state``: the last ``width`` rows of
    ``[state ; x[a:b]]``, channel-major."""
    width = state.shape[1]
    if b - a >= width:
        return x[b - width : b].t().to(state.dtype)
    return torch.cat([state[:, b - a :], x[a:b].t().to(state.dtype)], dim=1)


def _stack(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.stack(rows) if rows else like.new_empty(0, *like.shape[1:])


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


def _window_sum(rows: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """``sum_j rows[j] * weight[:, j]`` in FP32, j in order, each product added by ``addcmul_``:
    the one arithmetic of the prefill and the decode, so a token's output has the same bits in
    both.  The weight's columns are made contiguous first (once per weight, ``_columns``), so
    every operand is a contiguous row and each op runs vectorised."""
    columns = _columns(weight)
    out = rows[0] * columns[0]
    for row, column in zip(rows[1:], columns[1:]):
        out.addcmul_(row, column)
    return out


def _columns(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [C, kernel] as contiguous FP32 columns [kernel, C], kept on the weight
    (``derived``)."""
    return derived(weight, "_conv_columns", lambda w: w.t().float().contiguous())


def conv_decode(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [B, C]; states: [B, C, kernel - 1] -> ([B, C], new states).
    The window sum runs over token-major rows ``[state ; x]``, as ``conv_varlen`` computes it,
    so the decode gives the prefill's bits (no ``torch.cat`` along the kernel axis: at real
    shapes, 8,192 channels, it cost 55 us)."""
    batch, channels, width = states.shape
    rows = x.new_empty(batch, width + 1, channels, dtype=torch.float32)
    rows[:, :width] = states.transpose(1, 2)
    rows[:, width] = x
    out = _window_sum(rows.unbind(1), weight)
    # contiguous: index_copy_ from the strided view took 77 us
    new_states = rows[:, 1:].transpose(1, 2).to(states.dtype, memory_format=torch.contiguous_format)
    return F.silu(out.to(weight.dtype)).to(x.dtype), new_states


def conv_decode_into(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """``conv_decode`` of the sequences whose states are ``pool[slots]`` ([S, C, kernel - 1]),
    the new states written back into their slots.  At inference on a CPU this runs
    the C kernel (``cpu.py`` beside this file) where it is built: the same sums (the window sum
    in FP32, a product then one fused add per tap) in the slots, with no gathers, transposes or
    write-back (at 8,192 channels, 15 sequences: ~0.1 against ~1.7 ms a layer)."""
    sums = conv_in_place(x, _columns(weight), pool, slots.tolist()) if pool.is_cpu else None
    if sums is not None:
        return F.silu(sums.to(weight.dtype)).to(x.dtype)
    out, new_states = conv_decode(x, weight, pool.index_select(0, slots))
    pool.index_copy_(0, slots, new_states)
    return out
