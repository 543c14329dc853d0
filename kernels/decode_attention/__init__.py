"""Decode attention in C (``attention.c`` beside this file), CPU inference: one query token
per sequence over its KV rows where they lie in the pool, no gathered copy
(``model_runner/layers/attention.py``'s ``_decode_each`` is the torch form).  Its dot
products, exponential and softmax sum run in another order than torch's, so it agrees with the
torch form to the last bit of the model dtype (tests/kernels/test_cpu_attention_native.py); its
AVX-512 and portable forms give the same bits.  Returns None where it does not run (no C compiler,
``DASC_NATIVE_KERNELS=0``, a CPU without AVX-512, other dtypes or layouts, autograd).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import F32, I64, PTR, kernel_runs, load_library, simd_probe

SOURCE = Path(__file__).with_name("attention.c")
_SIGNATURES = {
    "dasc_attention_decode": (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64, I64, I64, F32, I64,
                              PTR, I64),
    "dasc_attention_simd": (),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "decode_attention", _SIGNATURES, "the C decode attention",
                        flags=("-fopenmp",), returns={"dasc_attention_decode": ctypes.c_int,
                                 "dasc_attention_simd": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 form runs here.  Without it the kernel declines: its portable form
    is the tests' reference, slower than torch."""
    return simd_probe(native_library(), "dasc_attention_simd")


def _runs(dim: int, simd: bool, *tensors: torch.Tensor) -> bool:
    return kernel_runs(native_library, simd_available, dim, simd, *tensors)


def attention_decode(q: torch.Tensor, cache: torch.Tensor, index: torch.Tensor,
                     starts: torch.Tensor, lens: torch.Tensor, scale: float,
                     simd: bool = True) -> torch.Tensor | None:
    """q [B, H, D] over the pool ``cache`` [R, 2, Hkv, D] (rows [K | V], bf16 or FP32, q's
    dtype): sequence b attends over rows ``index[starts[b] : starts[b] + lens[b]]`` (int64)
    -> [B, H, D] in q's dtype, or None.  Raises IndexError for a row outside the pool (the C
    code trusts them)."""
    num_seqs, heads, dim = q.shape
    if (q.dtype not in (torch.bfloat16, torch.float32) or cache.dtype != q.dtype
            or cache.dim() != 4 or cache.shape[1] != 2 or cache.shape[3] != dim
            or heads % cache.shape[2] or heads // cache.shape[2] > 16
            or not cache[0].is_contiguous() or not _runs(dim, simd, q, cache, index)
            or any(t.dtype != torch.long or t.dim() != 1 for t in (index, starts, lens))
            or len(starts) != num_seqs or len(lens) != num_seqs or not num_seqs
            or int(lens.min()) < 1):
        return None
    low, high = torch.aminmax(index)  # one pass over the step's rows
    if int(low) < 0 or int(high) >= cache.shape[0]:
        raise IndexError(f"KV rows outside [0, {cache.shape[0]})")
    q, index, starts, lens = (t.contiguous() for t in (q, index, starts, lens))
    out = torch.empty_like(q)
    kv_heads = cache.shape[2]
    failed = native_library().dasc_attention_decode(
        q.data_ptr(), cache.data_ptr(), cache.stride(0), kv_heads * dim, index.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), num_seqs, heads, kv_heads, dim, scale,
        int(q.dtype == torch.bfloat16), out.data_ptr(), int(simd))
    return None if failed else out
