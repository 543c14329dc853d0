"""Causal attention of a prefill chunk in C on AMX tiles (``attention.c`` beside this file), CPU
inference, bf16: a sequence's queries over its KV rows where they lie in the pool, no gathered
copy.  It stands in for ``F.scaled_dot_product_attention`` (``model_runner/layers/attention.py``'s
``causal_attention``) with the same arithmetic, in another summation order, so the two agree to
the rounding of bf16, not bit for bit; a query's output does not depend on the chunk it arrives
in (tests/kernels/test_cpu_prefill_attention.py).  Returns None where it does not run (no C
compiler, ``DASC_NATIVE_KERNELS=0``, a CPU without AMX, ``set_amx(False)``, other dtypes or
layouts, autograd).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import F32, I64, PTR, load_library, runs_here

SOURCE = Path(__file__).with_name("attention.c")
_SIGNATURES = {
    "dasc_attention_prefill": (PTR, PTR, I64, I64, PTR, I64, I64, I64, I64, I64, F32, PTR, I64),
    "dasc_attention_prefill_amx": (),
}
MAX_HEAD_DIM = 256  # attention.c's MAX_D


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "prefill_attention", _SIGNATURES,
                        "the CPU prefill attention on AMX", flags=("-fopenmp",),
                        returns={"dasc_attention_prefill": ctypes.c_int,
                                 "dasc_attention_prefill_amx": ctypes.c_int})


_amx_on = True


def set_amx(on: bool) -> None:
    """Let the kernel run where AMX is here, or never (``dasc-serve --cpu-amx-attention``;
    benchmarks time both forms in one process)."""
    global _amx_on
    _amx_on = on


@cache
def amx_available() -> bool:
    """Whether the kernel runs here: a CPU with AMX-BF16 and AVX512-BF16, and Linux granting
    the process the tile state."""
    lib = native_library()
    return lib is not None and bool(lib.dasc_attention_prefill_amx())


def amx_runs(head_dim: int) -> bool:
    """Whether a bf16 model's prefill attention with this head dim takes the kernel."""
    return (_amx_on and head_dim % 64 == 0 and head_dim <= MAX_HEAD_DIM
            and amx_available())


def attention_prefill(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                      prefix_len: int, scale: float) -> torch.Tensor | None:
    """q [n, H, D] bf16, the queries of positions [prefix_len, prefix_len + n), over the pool
    ``cache`` [R, 2, Hkv, D] (rows [K | V], bf16) rows ``rows`` [prefix_len + n] (int64, the
    positions' rows in order), causal -> [n, H, D] bf16, or None.  Raises IndexError for a row
    outside the pool (the C code trusts them)."""
    n, heads, dim = q.shape
    if (q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16 or cache.dim() != 4
            or cache.shape[1] != 2 or cache.shape[3] != dim or heads % cache.shape[2]
            or not cache[0].is_contiguous() or rows.dtype != torch.long or rows.dim() != 1
            or len(rows) != prefix_len + n or n < 1 or not amx_runs(dim)  # the library too
            or not runs_here(q, cache, rows)):
        return None
    low, high = torch.aminmax(rows)
    if int(low) < 0 or int(high) >= cache.shape[0]:
        raise IndexError(f"KV rows outside [0, {cache.shape[0]})")
    q, rows = q.contiguous(), rows.contiguous()
    out = torch.empty_like(q)
    kv_heads = cache.shape[2]
    status = native_library().dasc_attention_prefill(
        q.data_ptr(), cache.data_ptr(), cache.stride(0), kv_heads * dim, rows.data_ptr(),
        prefix_len, n, heads, kv_heads, dim, scale, out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("the CPU prefill attention could not allocate its scratch")
    return out if status == 0 else None
