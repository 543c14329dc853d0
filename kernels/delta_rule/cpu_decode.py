"""CPU decode of the gated delta rule in C (``cpu_decode.c`` beside this file): one token per
sequence, each state updated in place in its slot, with the bits of the torch form it stands in
for (``decode.py``'s ``decode_into``).  ``delta_rule_in_place`` returns None where it does not
run (no C compiler, ``DASC_NATIVE_KERNELS=0``, tensors not on the CPU or not FP32, autograd),
and the caller takes the torch form.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64, PTR, check_slots, enabled, load_library

SOURCE = Path(__file__).with_name("cpu_decode.c")
_SIGNATURES = {
    "dasc_delta_decode": (PTR, I64, PTR, I64, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, I64, PTR,
                          PTR, PTR, I64),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "delta_decode", _SIGNATURES, "the CPU delta rule decode",
                        flags=("-fopenmp",))


def delta_rule_in_place(pool: torch.Tensor, slots: list[int], wkq: torch.Tensor,
                        qk: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                        decay: torch.Tensor, k: torch.Tensor, simd: bool = True
                        ) -> torch.Tensor | None:
    """Advance ``pool[slots[b]]`` ([S, H, K, V] FP32) by one token in place: row b * H + h of
    the operands (``decode._operands``: wkq [BH, 2, K], qk, v [BH, 1, V], beta,
    decay [BH, 1 or K, 1], k [BH, K, 1]) belongs to head h of sequence b.  Returns
    o [BH, 1, V] FP32, or None where the kernel does not run.  ``simd=False`` takes the
    portable loop (tests)."""
    num_heads, k_dim, v_dim = pool.shape[1:]
    operands = (wkq, qk, v, beta, decay, k)
    if (pool.device.type != "cpu" or pool.dtype != torch.float32 or torch.is_grad_enabled()
            or not pool[0].is_contiguous() or pool.stride(0) < num_heads * k_dim * v_dim
            or any(x.dtype != torch.float32 for x in operands) or not enabled()
            or native_library() is None):
        return None
    wkq, qk, v, beta, decay, k = (x.contiguous() for x in operands)
    index = check_slots(slots, pool.shape[0])
    o = torch.empty(len(slots) * num_heads, 1, v_dim)
    scratch = torch.empty(v_dim)
    native_library().dasc_delta_decode(
        pool.data_ptr(), pool.stride(0), index.data_ptr(), len(slots), num_heads, k_dim,
        v_dim, wkq.data_ptr(), qk.data_ptr(), v.data_ptr(), beta.data_ptr(), decay.data_ptr(),
        int(decay.shape[1] != 1), k.data_ptr(), o.data_ptr(), scratch.data_ptr(), int(simd))
    return o
