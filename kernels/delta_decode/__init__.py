"""The gated delta rule's one-token update on CPU in one pass over each state (``native.c``
beside this file; ``model_runner/ops/delta_rule_decode.py`` is the torch form and reference).

``decode_in_place`` runs it where it can and returns None elsewhere (no C compiler,
``DASC_NATIVE_KERNELS=0``, a non-CPU or non-FP32 state, autograd), so the caller takes the
torch form, which gives the same bits.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64, PTR, load_library

SOURCE = Path(__file__).with_name("native.c")
_SIGNATURES = {"dasc_delta_decode": (PTR, I64, PTR, I64, I64, I64, I64, PTR, PTR, PTR, PTR,
                                     PTR, I64, PTR, PTR, PTR, I64)}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "delta_decode", _SIGNATURES, "CPU delta-rule decode kernel")


def decode_in_place(pool: torch.Tensor, slots: list[int], wkq: torch.Tensor, qk: torch.Tensor,
                    v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, k: torch.Tensor,
                    simd: bool = True) -> torch.Tensor | None:
    """Advance ``pool[slots[b]]`` ([S, H, K, V] FP32) by one token in place: row b * H + h of
    the operands (``delta_rule_decode._operands``: wkq [BH, 2, K], qk, v [BH, 1, V], beta,
    decay [BH, 1 or K, 1], k [BH, K, 1]) belongs to head h of sequence b.  Returns
    o [BH, 1, V] FP32, or None where the kernel does not run.  ``simd=False`` takes the
    portable loop (tests)."""
    num_heads, k_dim, v_dim = pool.shape[1:]
    operands = (wkq, qk, v, beta, decay, k)
    if (pool.device.type != "cpu" or pool.dtype != torch.float32 or torch.is_grad_enabled()
            or not pool[0].is_contiguous() or pool.stride(0) < num_heads * k_dim * v_dim
            or any(x.dtype != torch.float32 for x in operands) or native_library() is None):
        return None
    wkq, qk, v, beta, decay, k = (x.contiguous() for x in operands)
    if slots and (min(slots) < 0 or max(slots) >= pool.shape[0]):  # the C code trusts them
        raise IndexError(f"state slots {slots} outside [0, {pool.shape[0]})")
    index = torch.tensor(slots, dtype=torch.long)
    o = torch.empty(len(slots) * num_heads, 1, v_dim)
    scratch = torch.empty(v_dim)
    native_library().dasc_delta_decode(
        pool.data_ptr(), pool.stride(0), index.data_ptr(), len(slots), num_heads, k_dim,
        v_dim, wkq.data_ptr(), qk.data_ptr(), v.data_ptr(), beta.data_ptr(), decay.data_ptr(),
        int(decay.shape[1] != 1), k.data_ptr(), o.data_ptr(), scratch.data_ptr(), int(simd))
    return o
