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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64, PTR, enabled, kernel_runs, load_library, simd_probe

SOURCE = Path(__file__).with_name("gemv.c")
_SIGNATURES = {
    "dasc_gemv": (PTR, I64, I64, PTR, I64, PTR, I64),
    "dasc_gemv_simd": (),
    "dasc_code_heads": (PTR, I64, I64, PTR),
    "dasc_code": (PTR, I64, I64, PTR, PTR, PTR, PTR),
    "dasc_gemv_coded": (PTR, I64, I64, PTR, PTR, PTR, PTR, I64, PTR, I64),
    "dasc_coded_rows": (PTR, PTR, PTR, PTR, I64, PTR, I64, PTR, I64),
}

GEMV_MAX_ROWS = 4  # its sums stay in registers: four weight rows by four rows of x


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "gemv", _SIGNATURES, "the C decode GEMV", flags=("-fopenmp",),
                        returns={"dasc_gemv": ctypes.c_int, "dasc_gemv_simd": ctypes.c_int,
                                 "dasc_code_heads": None, "dasc_code": None,
                                 "dasc_gemv_coded": ctypes.c_int, "dasc_coded_rows": None})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 form runs here.  Without it the kernel declines: its portable form
    is the tests' reference, slower than oneDNN."""
    return simd_probe(native_library(), "dasc_gemv_simd")


CODE_BLOCK = 64  # elements a header byte covers (cpu_coded.h)
RAW = 0xFF  # the header of a block kept with its high bytes


@dataclass(frozen=True, slots=True)
class CodedWeight:
    """A bf16 weight [N, K] in 12 bits an element (the format: ``kernels/cpu_coded.h``): each
    element's low byte as it is, its high byte (sign, top exponent bits) as a 4-bit code into
    its 64-element block's window, the blocks that do not fit with their high bytes in a side
    run.  The same values, 3/4 of the bytes a decode step streams.  ``body`` [N, K / 64, 96]
    and ``head`` [N, K / 64] uint8, ``side`` uint8 (at least one byte), ``side_at`` [N] int64
    (row r's side run starts there).  Made once from the weight: a weight changed later keeps
    the old copy."""

    body: torch.Tensor
    head: torch.Tensor
    side: torch.Tensor
    side_at: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.head.shape[0], self.head.shape[1] * CODE_BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.body, self.head, self.side, self.side_at))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.body, self.head, self.side, self.side_at


def code_weight(weight: torch.Tensor) -> CodedWeight | None:
    """``weight``'s coded copy for the C GEMV, or None where it would not run: not a contiguous
    2-D bf16 CPU weight, K not a multiple of 64, no AVX-512 form here (the portable form
    decodes each row before its products: a reference, not faster)."""
    if (weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous()
            or not weight.is_cpu or weight.shape[1] % CODE_BLOCK or weight.shape[1] == 0
            or not enabled() or native_library() is None or not simd_available()):
        return None
    return _code(weight.detach())


def coded_rows(coded: CodedWeight, ids: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """Rows ``ids`` of the weight ``coded`` stands for, exactly: bf16 [*ids.shape, K], as
    ``F.embedding(ids, weight)`` gives them (an id out of range raises IndexError); AVX-512
    decodes them where it runs unless ``simd`` is False (the portable form, the tests')."""
    n, k = coded.shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must lie in [0, {n})")
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16)
    native_library().dasc_coded_rows(*(t.data_ptr() for t in coded.tensors()), k,
                                     flat.data_ptr(), flat.numel(), out.data_ptr(), int(simd))
    return out.view(*ids.shape, k)


def _code(weight: torch.Tensor) -> CodedWeight:
    lib, (n, k) = native_library(), weight.shape
    head = torch.empty(n, k // CODE_BLOCK, dtype=torch.uint8)
    lib.dasc_code_heads(weight.data_ptr(), n, k, head.data_ptr())
    raw_bytes = (head == RAW).sum(dim=1) * CODE_BLOCK  # each row's side run
    side_at = (raw_bytes.cumsum(0) - raw_bytes).contiguous()
    side = torch.empty(max(1, int(raw_bytes.sum())), dtype=torch.uint8)
    body = torch.empty(n, k // CODE_BLOCK, 96, dtype=torch.uint8)
    lib.dasc_code(weight.data_ptr(), n, k, head.data_ptr(), body.data_ptr(), side.data_ptr(),
                  side_at.data_ptr())
    return CodedWeight(body, head, side, side_at)


def gemv(x: torch.Tensor, weight: torch.Tensor | None, simd: bool = True,
         coded: CodedWeight | None = None) -> torch.Tensor | None:
    """``x W^T`` for x [..., K] of at most ``GEMV_MAX_ROWS`` rows and weight [N, K], both bf16
    (weight contiguous) -> [..., N] bf16, each output summed in FP32 and rounded once; None
    where it does not run.  With ``coded`` (``code_weight(weight)``) it streams the coded copy
    instead: the same bits; ``weight`` may then be None (a linear that released its weight,
    ``PackedGemm.release_weight``)."""
    if weight is None:
        if coded is None:
            raise ValueError("gemv needs the weight or its coded copy")
        (n, k_w), held = coded.shape, ()
    elif weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    else:
        (n, k_w), held = weight.shape, (weight,)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 0 < rows <= GEMV_MAX_ROWS or k % 32 or k_w != k or x.dtype != torch.bfloat16
            or not kernel_runs(native_library, simd_available, k, simd, x, *held)):
        return None
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if coded is not None:
        failed = native_library().dasc_gemv_coded(
            flat.data_ptr(), rows, k, *(t.data_ptr() for t in coded.tensors()), n,
            out.data_ptr(), int(simd))
    else:
        failed = native_library().dasc_gemv(flat.data_ptr(), rows, k, weight.data_ptr(), n,
                                            out.data_ptr(), int(simd))
    return None if failed else out.view(*x.shape[:-1], n)
