"""A decode step's GEMMs in C (``gemv.c`` beside this file), CPU inference: ``x W^T`` for a few
bf16 rows ``x`` and a bf16 weight ``W`` [N, K] as the checkpoint stores it, the weight streamed
once for all rows, four weight rows at a time with the next four prefetched.  On one core it
reads the weight at ~13-15 GB/s where oneDNN's packed GEMM of 1-4 rows reads 10-13
(docs/benchmarks.md, "A decode step's GEMMs").

Each output sums in one fixed order that depends neither on the number of rows nor on the
weight's size, so a row's bits do not depend on the rows beside it; the AVX-512 and portable
forms give the same bits (tests/kernels/test_cpu_gemv_native.py).  Returns None where it does not
run (no C compiler, ``DASC_NATIVE_KERNELS=0``, a CPU without AVX-512, more than
``GEMV_MAX_ROWS`` rows, K not a multiple of 32, other dtypes or layouts, autograd).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64, PTR, kernel_runs, load_library, simd_probe

SOURCE = Path(__file__).with_name("gemv.c")
_SIGNATURES = {"dasc_gemv": (PTR, I64, I64, PTR, I64, PTR, I64), "dasc_gemv_simd": ()}

GEMV_MAX_ROWS = 4  # its sums stay in registers: four weight rows by four rows of x


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "gemv", _SIGNATURES, "the C decode GEMV", flags=("-fopenmp",),
                        returns={"dasc_gemv": ctypes.c_int, "dasc_gemv_simd": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 form runs here.  Without it the kernel declines: its portable form
    is the tests' reference, slower than oneDNN."""
    return simd_probe(native_library(), "dasc_gemv_simd")


def gemv(x: torch.Tensor, weight: torch.Tensor, simd: bool = True) -> torch.Tensor | None:
    """``x W^T`` for x [..., K] of at most ``GEMV_MAX_ROWS`` rows and weight [N, K], both bf16
    (weight contiguous) -> [..., N] bf16, each output summed in FP32 and rounded once; None
    where it does not run."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 0 < rows <= GEMV_MAX_ROWS or k % 32
            or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous()
            or not kernel_runs(native_library, simd_available, k, simd, x, weight)):
        return None
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
    failed = native_library().dasc_gemv(flat.data_ptr(), rows, k, weight.data_ptr(),
                                        weight.shape[0], out.data_ptr(), int(simd))
    return None if failed else out.view(*x.shape[:-1], weight.shape[0])
