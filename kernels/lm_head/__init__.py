"""Greedy tokens from a large LM head without its full GEMV (CPU inference, bf16, one rank).

A decode step at Qwen3.5-0.8B's shape reads 1.5 GB of weights, a third of them the tied LM head
(248,320 x 1,024 bf16).  A greedy row needs only the argmax of its logits, so ``ScreenedHead``
reads an int8 copy of the head instead (half the bytes, ``screen.c`` beside this file), bounds
each logit's distance from the screening value rigorously, and computes exactly, with the same
C GEMV the full head uses (``kernels/gemv``: a row's bits depend neither on the rows beside it
nor on the weight's size), only the rows whose bound reaches the best lower bound.  The token is
the full head's: the first index of the largest bf16 logit.

The bound, for hidden row x (bf16) and weight row w, x~ = s_x round(x / s_x) and
w~ = s_w round(w 127 / max |w|) the int8 copies (s = max |.| / 127), g the GEMV's FP32 sum:

    |g - x~.w~| <= |g - x.w| + |x.(w - w~)| + |(x - x~).w~|
                <= gamma_K |x|_1 max|w| + |x|_1 max|w - w~| + (s_x / 2) |w~|_1,

gamma_K = K u / (1 - K u) with u = 2^-24 (the FP32 sum of K exact bf16 products, in any
order); x~.w~ is an exact integer sum times s_x s_w, and the terms' own FP32 evaluation is
covered by a relative slack of 1e-4 and 4u |x~.w~|.  A row whose upper bound lies more than
two bf16 units (at the largest magnitude in play) below the best lower bound cannot round to
the largest bf16 logit, so it is no candidate; every other row is computed exactly.  A step
whose rows have more than ``MAX_CANDIDATES`` candidates, a non-finite hidden value or weight,
or rows the full head would not compute with the C GEMV (more than ``GEMV_MAX_ROWS``) takes the
full head.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from kernels.gemv import GEMV_MAX_ROWS, gemv
from kernels.native_build import F32, I64, PTR, load_library, runs_here, simd_probe

SOURCE = Path(__file__).with_name("screen.c")
_SIGNATURES = {"dasc_screen": (PTR, I64, I64, PTR, I64, PTR, I64), "dasc_screen_simd": (),
               "dasc_screen_quantize": (PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR),
               "dasc_screen_candidates": (PTR, I64, PTR, PTR, PTR, PTR, PTR, F32, F32, F32, F32,
                                          I64, PTR)}

MAX_CANDIDATES = 4096  # rows computed exactly per hidden row, at most (~8 MB at K = 1,024)
_U = 2.0**-24  # FP32's unit roundoff
_SLACK = 1e-4  # relative, for the bound's own FP32 evaluation


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "lm_head_screen", _SIGNATURES, "the LM head's int8 screen",
                        flags=("-fopenmp",),
                        returns={"dasc_screen": ctypes.c_int, "dasc_screen_simd": ctypes.c_int,
                                 "dasc_screen_quantize": ctypes.c_int,
                                 "dasc_screen_candidates": ctypes.c_int64})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 VNNI form runs here (without it the screen is slower than the full
    head, so nothing is screened)."""
    return simd_probe(native_library(), "dasc_screen_simd")


def screen_dots(xu: torch.Tensor, wq: torch.Tensor, simd: bool = True) -> torch.Tensor | None:
    """xu [m, K] uint8 . wq [N, K]^T int8 -> exact int32 sums [m, N]; None where it does not
    run (no library, m outside [1, 4], K not a multiple of 64)."""
    m, k = xu.shape
    if (native_library() is None or not 1 <= m <= GEMV_MAX_ROWS or k % 64 or k == 0
            or xu.dtype != torch.uint8 or wq.dtype != torch.int8 or wq.shape[1] != k
            or not (xu.is_contiguous() and wq.is_contiguous())):
        return None
    out = torch.empty(m, wq.shape[0], dtype=torch.int32)
    failed = native_library().dasc_screen(xu.data_ptr(), m, k, wq.data_ptr(), wq.shape[0],
                                          out.data_ptr(), int(simd))
    return None if failed else out


class ScreenedHead:
    """The int8 copy of a bf16 LM head weight [V, K] and what its bound needs, per row."""

    def __init__(self, weight: torch.Tensor, out: torch.Tensor | None = None,
                 rows: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``weight``: the head's bf16 [V, K] tensor; the int8 copy is made in C
        (``native_library`` must load), into ``out`` (an untouched contiguous int8 [V, K]
        tensor: a serving rank's is in huge pages, as it is streamed every step) or a new
        tensor.  The candidates are computed from ``rows(ids)``, the head's rows ``ids``
        exactly (a runner's head may give them from its coded copy once it drops the weight),
        else from ``weight``, which is then kept."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("the screened head reads a contiguous bf16 [vocab, hidden] weight")
        if native_library() is None:
            raise RuntimeError("the LM head's int8 screen is not built here (no C compiler, or "
                               "DASC_NATIVE_KERNELS=0)")
        self.rows = rows or (lambda ids: weight.index_select(0, ids))
        v, k = weight.shape
        if out is not None and (out.shape != (v, k) or out.dtype != torch.int8
                                or not out.is_contiguous()):
            raise ValueError(f"the int8 copy needs a contiguous int8 [{v}, {k}] tensor")
        self.wq = out if out is not None else torch.empty(v, k, dtype=torch.int8)
        self.scale = torch.empty(v)  # s_w
        self.rowsum = torch.empty(v, dtype=torch.int32)  # sum of the int8 row (for x + 128)
        self.err = torch.empty(v)  # max |w - w~|
        self.l1 = torch.empty(v)  # |w~|_1
        self.wmax = torch.empty(v)  # max |w|
        bad = native_library().dasc_screen_quantize(
            weight.data_ptr(), v, k, self.wq.data_ptr(), self.scale.data_ptr(),
            self.rowsum.data_ptr(), self.err.data_ptr(), self.l1.data_ptr(), self.wmax.data_ptr())
        self.finite = not bad  # a non-finite weight leaves every step to the full head
        self.gamma = k * _U / (1 - k * _U)
        self._ids = torch.empty(MAX_CANDIDATES, dtype=torch.int64)  # a row's candidates

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.wq, self.scale, self.rowsum, self.err, self.l1, self.wmax))

    def argmax(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's greedy token under the full head (``hidden`` [m, K] bf16, the normed
        hidden states the head reads), or None where the full head must run instead."""
        if (not self.finite or hidden.dim() != 2 or not 1 <= hidden.shape[0] <= GEMV_MAX_ROWS
                or hidden.dtype != torch.bfloat16 or not runs_here(hidden)):
            return None
        x = hidden.float()
        if not torch.isfinite(x).all():
            return None
        amax = x.abs().amax(dim=1, keepdim=True)
        s_x = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        xq = torch.round(x / s_x).clamp_(-127, 127)
        dots = screen_dots((xq + 128).to(torch.uint8), self.wq)
        if dots is None:
            return None
        x1 = x.abs().sum(dim=1)
        ids, lib, tokens = self._ids, native_library(), []
        for i in range(x.shape[0]):
            count = lib.dasc_screen_candidates(
                dots[i].data_ptr(), dots.shape[1], self.rowsum.data_ptr(), self.scale.data_ptr(),
                self.err.data_ptr(), self.l1.data_ptr(), self.wmax.data_ptr(), float(s_x[i]),
                float(x1[i]), self.gamma, _SLACK, MAX_CANDIDATES, ids.data_ptr())
            if count < 0:
                return None
            rows = ids[:count]
            exact = gemv(hidden[i : i + 1], self.rows(rows))
            if exact is None:
                return None
            tokens.append(int(rows[exact.float().max(dim=-1).indices]))
        return tokens
