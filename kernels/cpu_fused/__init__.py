"""Passes fused in C (``fused.c`` beside this file), CPU inference:

- ``gated_rmsnorm``: the silu-gated output norm of Qwen3-Next and Qwen3.5 from the delta rule's
  FP32 output, with the model dtype's roundings (``layers/norm.py``'s ``GatedRMSNorm`` is the
  torch form);
- ``l2norm_qkv``: q and k L2-normalised and v converted to FP32, straight from the conv's
  output (``ops/delta_rule.py``'s ``l2norm_rsqrt`` is the torch form);
- ``silu_mul``: a dense MLP's ``silu(gate) * up`` from the gate-up projection's output;
- ``rmsnorm``: an RMS norm of rows in the roundings of each architecture (``layers/norm.py``'s
  ``RMSNorm`` is the torch form);
- ``moe_decode``: the routed experts of a decode step's few tokens, each used expert's weights
  streamed once (``layers/mlp.py``'s ``_routed_experts`` is the torch form);
- ``attention_decode``: one query token per sequence over its KV rows where they lie in the
  pool (``layers/attention.py``'s ``_decode_each`` is the torch form), no gathered copy.

Their sums and exponentials run in another order than torch's, so they agree with the torch
forms to the last bit of the model dtype, not bit for bit (tests/test_cpu_fused_native.py).
Each returns None where it does not run (no C compiler, ``DASC_NATIVE_KERNELS=0``, a CPU
without AVX-512 or rows not a multiple of 16 wide, tensors not on the CPU or not in the dtypes
and layouts it reads, autograd), and the caller takes torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import F32, I64, PTR, enabled, load_library

SOURCE = Path(__file__).with_name("fused.c")
_SIGNATURES = {
    "dasc_gated_rmsnorm": (PTR, PTR, I64, PTR, I64, I64, I64, F32, I64, PTR, I64),
    "dasc_l2norm_qkv": (PTR, I64, I64, I64, I64, F32, I64, I64, PTR, PTR, PTR, I64),
    "dasc_silu_mul": (PTR, I64, I64, I64, I64, PTR, I64),
    "dasc_attention_decode": (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64, I64, I64, F32, I64,
                              PTR, I64),
    "dasc_rmsnorm": (PTR, I64, I64, I64, PTR, F32, I64, I64, PTR, I64),
    "dasc_moe_decode": (PTR, I64, I64, I64, PTR, PTR, I64, PTR, PTR, PTR, PTR, I64, PTR, I64,
                        PTR, I64),
    "dasc_fused_simd": (),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "cpu_fused", _SIGNATURES, "the fused CPU activation kernels",
                        returns={"dasc_fused_simd": ctypes.c_int,
                                 "dasc_attention_decode": ctypes.c_int,
                                 "dasc_moe_decode": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 forms run here.  Without them the kernels decline: their portable
    forms (a scalar exponential) are references for the tests, slower than torch."""
    lib = native_library()
    return lib is not None and bool(lib.dasc_fused_simd())


def _runs(dim: int, simd: bool, *tensors: torch.Tensor) -> bool:
    """The kernels run on CPU tensors without autograd, in the AVX-512 form (rows of a
    multiple of 16 on an AVX-512 CPU) unless ``simd`` is False (tests)."""
    return (all(t.device.type == "cpu" for t in tensors) and not torch.is_grad_enabled()
            and enabled() and native_library() is not None
            and (not simd or (dim % 16 == 0 and simd_available())))


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                  simd: bool = True) -> torch.Tensor | None:
    """o [N, H, D] FP32, z [N, H * D] (bf16 or FP32, rows at any stride), weight [D] FP32 ->
    [N * H, D] in z's dtype, or None."""
    n, heads, dim = o.shape
    if (not _runs(dim, simd, o, z, weight) or o.dtype != torch.float32 or not o.is_contiguous()
            or z.dtype not in (torch.bfloat16, torch.float32) or z.dim() != 2
            or z.stride(1) != 1 or z.shape != (n, heads * dim) or weight.dtype != torch.float32
            or not weight.is_contiguous()):
        return None
    out = torch.empty(n * heads, dim, dtype=z.dtype)
    native_library().dasc_gated_rmsnorm(
        o.data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(), n, heads, dim, eps,
        int(z.dtype == torch.bfloat16), out.data_ptr(), int(simd))
    return out


def l2norm_qkv(x: torch.Tensor, key_heads: int, dim: int, eps: float = 1e-6,
               simd: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [N, 2 * key_heads * dim + E] (bf16 or FP32, rows at any stride) -> (q, k
    [N, key_heads, dim] L2-normalised, v [N, E]), FP32, or None."""
    if (not _runs(dim, simd, x) or x.dtype not in (torch.bfloat16, torch.float32)
            or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] <= 2 * key_heads * dim):
        return None
    n, values = x.shape[0], x.shape[1] - 2 * key_heads * dim
    q, k = (torch.empty(n, key_heads, dim) for _ in range(2))
    v = torch.empty(n, values)
    native_library().dasc_l2norm_qkv(
        x.data_ptr(), x.stride(0), n, key_heads, dim, eps, values,
        int(x.dtype == torch.bfloat16), q.data_ptr(), k.data_ptr(), v.data_ptr(), int(simd))
    return q, k, v


def silu_mul(x: torch.Tensor, simd: bool = True) -> torch.Tensor | None:
    """x [N, 2 * D] = [gate | up] (bf16 or FP32, rows at any stride) -> silu(gate) * up
    [N, D] in x's dtype, rounded where torch rounds, or None."""
    if (x.dim() != 2 or x.shape[1] % 2 or not _runs(x.shape[1] // 2, simd, x)
            or x.dtype not in (torch.bfloat16, torch.float32) or x.stride(1) != 1):
        return None
    n, dim = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, dim, dtype=x.dtype)
    native_library().dasc_silu_mul(x.data_ptr(), x.stride(0), n, dim,
                                   int(x.dtype == torch.bfloat16), out.data_ptr(), int(simd))
    return out


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
    if int(index.min()) < 0 or int(index.max()) >= cache.shape[0]:
        raise IndexError(f"KV rows outside [0, {cache.shape[0]})")
    q, index, starts, lens = (t.contiguous() for t in (q, index, starts, lens))
    out = torch.empty_like(q)
    kv_heads = cache.shape[2]
    failed = native_library().dasc_attention_decode(
        q.data_ptr(), cache.data_ptr(), cache.stride(0), kv_heads * dim, index.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), num_seqs, heads, kv_heads, dim, scale,
        int(q.dtype == torch.bfloat16), out.data_ptr(), int(simd))
    return None if failed else out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool,
            simd: bool = True) -> torch.Tensor | None:
    """x [..., D] (bf16 or FP32) -> ``round(w * round(x_hat))`` (``round_first``) or
    ``round(w * x_hat)``, x_hat = x * rsqrt(mean(x^2) + eps), in x's dtype; weight [D] FP32 as
    the norm applies it.  None where it does not run."""
    dim = x.shape[-1]
    if (x.dtype not in (torch.bfloat16, torch.float32) or not x.numel()
            or not _runs(dim, simd, x, weight) or weight.dtype != torch.float32
            or weight.shape != (dim,) or not weight.is_contiguous()):
        return None
    rows = x.reshape(-1, dim)  # a view for the row-uniform strides of the norms' inputs
    if rows.stride(1) != 1:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    native_library().dasc_rmsnorm(rows.data_ptr(), rows.stride(0), rows.shape[0], dim,
                                  weight.data_ptr(), eps, int(x.dtype == torch.bfloat16),
                                  int(round_first), out.data_ptr(), int(simd))
    return out.view(x.shape)


MOE_DECODE_MAX_TOKENS = 8  # its per-token sums stay in the first two cache levels


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, shared: tuple | None = None, simd: bool = True
               ) -> torch.Tensor | None:
    """x [T, H] routed to experts ``ids`` [T, k] (int64) with ``weights`` [T, k] through
    w13 [E, H, 2I] and w2 [E, I, H] (input-major, x's dtype), then the shared expert
    ``shared`` = (w13 [H, 2Is], w2 [Is, H], its weights [T] or None for 1) added last ->
    [T, H] in x's dtype, rounded where ``SparseMoE`` rounds; None where it does not run (more
    than ``MOE_DECODE_MAX_TOKENS`` tokens, other dtypes or layouts).  Raises IndexError for
    an expert id outside [0, E) (the C code trusts them)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[1]
    s13, s2, s_weights = shared if shared is not None else (None, None, None)
    tensors = (weights, w13, w2, *(t for t in (s13, s2, s_weights) if t is not None))
    if (not 0 < num_tokens <= MOE_DECODE_MAX_TOKENS
            or x.dtype not in (torch.bfloat16, torch.float32)
            or any(t.dtype != x.dtype for t in tensors)
            or w13.shape != (num_experts, hidden, 2 * inter) or w2.shape[2] != hidden
            or ids.dtype != torch.long or ids.shape != weights.shape or ids.shape[0] != num_tokens
            or not all(t.is_contiguous() for t in (w13, w2))
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
    if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise IndexError(f"expert ids outside [0, {num_experts})")
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    out = torch.zeros_like(x)
    failed = native_library().dasc_moe_decode(
        x.data_ptr(), num_tokens, hidden, inter, ids.data_ptr(), weights.data_ptr(),
        ids.shape[1], w13.data_ptr(), w2.data_ptr(), *(_ptr(t) for t in (s13, s2)),
        shared_inter, _ptr(s_weights), int(x.dtype == torch.bfloat16), out.data_ptr(),
        int(simd))
    return None if failed else out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
