"""MoE decode in C (``experts.c`` beside this file), CPU inference: the experts of a decode
step's few tokens, routed and shared, each used expert's weights streamed once from their
input-major storage (``model_runner/layers/mlp.py``'s ``SparseMoE`` forms are the torch forms).
Each product sums its input rows in order, so it agrees with oneDNN's GEMMs to the last bit of
the model dtype (tests/kernels/test_cpu_moe_native.py); its AVX-512 and portable forms give the same
bits.  Returns None where it does not run (no C compiler, ``DASC_NATIVE_KERNELS=0``, a CPU
without AVX-512, more tokens than ``MOE_DECODE_MAX_TOKENS``, other dtypes or layouts,
autograd).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.gemv import CodedWeight, code_weight
from kernels.native_build import I64, PTR, kernel_runs, load_library, simd_probe

SOURCE = Path(__file__).with_name("experts.c")
_SIGNATURES = {
    "dasc_moe_decode": (PTR, I64, I64, I64, PTR, PTR, I64, PTR, PTR, PTR, PTR, I64, PTR, I64,
                        PTR, I64, PTR),
    "dasc_moe_simd": (),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "moe_decode", _SIGNATURES, "the C MoE decode",
                        flags=("-fopenmp",),
                        returns={"dasc_moe_decode": ctypes.c_int, "dasc_moe_simd": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 form runs here.  Without it the kernel declines: its portable form
    is the tests' reference, slower than torch."""
    return simd_probe(native_library(), "dasc_moe_simd")


def _runs(dim: int, simd: bool, *tensors: torch.Tensor) -> bool:
    return kernel_runs(native_library, simd_available, dim, simd, *tensors)


MOE_DECODE_MAX_TOKENS = 8  # its per-token sums stay in the first two cache levels


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               w13: torch.Tensor | None, w2: torch.Tensor | None, shared: tuple | None = None,
               simd: bool = True, coded: tuple[CodedWeight | None, ...] | None = None
               ) -> torch.Tensor | None:
    """x [T, H] routed to experts ``ids`` [T, k] (int64) with ``weights`` [T, k] through
    w13 [E, H, 2I] and w2 [E, I, H] (input-major, x's dtype), then the shared expert
    ``shared`` = (w13 [H, 2Is], w2 [Is, H], its weights [T] or None for 1) added last ->
    [T, H] in x's dtype, rounded where ``SparseMoE`` rounds; None where it does not run (more
    than ``MOE_DECODE_MAX_TOKENS`` tokens, other dtypes or layouts).  ``coded``: the coded
    copies (``code_experts``) it streams instead of the weights, where not None: the same
    bits; w13 and w2 may then be None (a layer that dropped them,
    ``SparseMoE.release_experts``).  Raises IndexError for an expert id outside [0, E) (the C
    code trusts them)."""
    num_tokens, hidden = x.shape
    if w13 is None or w2 is None:
        if coded is None or coded[0] is None or coded[1] is None:
            raise ValueError("moe_decode needs the experts' weights or their coded copies")
        w13 = w2 = None
        (rows13, width13), (rows2, width2) = coded[0].shape, coded[1].shape
        inter = width13 // 2
        num_experts = rows2 // inter if inter else 0
        fits = (x.dtype == torch.bfloat16 and width2 == hidden and inter > 0
                and rows13 == num_experts * hidden and rows2 == num_experts * inter)
    else:
        num_experts, inter = w2.shape[0], w2.shape[1]
        fits = (w13.shape == (num_experts, hidden, 2 * inter) and w2.shape[2] == hidden
                and w13.is_contiguous() and w2.is_contiguous())
    s13, s2, s_weights = shared if shared is not None else (None, None, None)
    tensors = tuple(t for t in (weights, w13, w2, s13, s2, s_weights) if t is not None)
    if (not fits or not 0 < num_tokens <= MOE_DECODE_MAX_TOKENS
            or x.dtype not in (torch.bfloat16, torch.float32)
            or any(t.dtype != x.dtype for t in tensors)
            or ids.dtype != torch.long or ids.shape != weights.shape or ids.shape[0] != num_tokens
            or not _runs(hidden, simd, x, *tensors) or (simd and inter % 16)):
        return None
    shared_inter = 0
    if s13 is not None:
        shared_inter = s2.shape[0]
        if (s13.shape != (hidden, 2 * shared_inter) or s2.shape != (shared_inter, hidden)
                or not (s13.is_contiguous() and s2.is_contiguous())
                or (s_weights is not None and s_weights.numel() != num_tokens)
                or (simd and shared_inter % 16)):
            return None
        s_weights = s_weights.contiguous() if s_weights is not None else None
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= num_experts:
        raise IndexError(f"expert ids outside [0, {num_experts})")
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    out = torch.zeros_like(x)
    failed = native_library().dasc_moe_decode(
        x.data_ptr(), num_tokens, hidden, inter, ids.data_ptr(), weights.data_ptr(),
        ids.shape[1], *(_ptr(t) for t in (w13, w2, s13, s2)),
        shared_inter, _ptr(s_weights), int(x.dtype == torch.bfloat16), out.data_ptr(),
        int(simd), _codes(coded))
    return None if failed else out


def code_experts(w13: torch.Tensor, w2: torch.Tensor, shared: tuple | None = None
                 ) -> tuple[CodedWeight | None, ...] | None:
    """``moe_decode``'s ``coded``: the coded copies of w13 as [E H, 2I], w2 as [E I, H] and the
    shared expert's (w13 [H, 2Is], w2 [Is, H]), each None where it cannot be coded (not bf16,
    rows not whole 64-element blocks); None where none can."""
    flat = (w13.reshape(-1, w13.shape[-1]), w2.reshape(-1, w2.shape[-1]), *(shared or ()))
    coded = tuple(code_weight(w) for w in flat)
    return coded if any(c is not None for c in coded) else None


def _codes(coded: tuple[CodedWeight | None, ...] | None):
    """The C side's ``Coded codes[4]`` (NULL bodies where None), or NULL."""
    if coded is None:
        return None
    ptrs = [p for c in (*coded, None, None)[:4]
            for p in (c.tensors() if c is not None else (None,) * 4)]
    return (ctypes.c_void_p * 16)(*(t if t is None else t.data_ptr() for t in ptrs))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
