"""Norm and activation passes fused in C (``fused.c`` beside this file), CPU inference:

- ``gated_rmsnorm``: the silu-gated output norm of Qwen3-Next and Qwen3.5 from the delta rule's
  FP32 output, with the model dtype's roundings (``layers/norm.py``'s ``GatedRMSNorm`` is the
  torch form);
- ``l2norm_qkv``: q and k L2-normalised and v converted to FP32, straight from the conv's
  output (``kernels/delta_rule/naive.py``'s ``l2norm_rsqrt`` is the torch form);
- ``silu_mul``: a dense MLP's ``silu(gate) * up`` from the gate-up projection's output;
- ``rmsnorm``: an RMS norm of rows in the roundings of each architecture (``layers/norm.py``'s
  ``RMSNorm`` is the torch form).

Their sums and exponentials run in another order than torch's, so they agree with the torch
forms to the last bit of the model dtype, not bit for bit (tests/kernels/test_cpu_fused_native.py).
Each returns None where it does not run (no C compiler, ``DASC_NATIVE_KERNELS=0``, a CPU
without AVX-512 or rows not a multiple of 16 wide, tensors not on the CPU or not in the dtypes
and layouts it reads, autograd), and the caller takes torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import F32, I64, PTR, kernel_runs, load_library, simd_probe

SOURCE = Path(__file__).with_name("fused.c")
_SIGNATURES = {
    "dasc_gated_rmsnorm": (PTR, PTR, I64, PTR, I64, I64, I64, F32, I64, PTR, I64),
    "dasc_l2norm_qkv": (PTR, I64, I64, I64, I64, F32, I64, I64, PTR, PTR, PTR, I64),
    "dasc_silu_mul": (PTR, I64, I64, I64, I64, PTR, I64),
    "dasc_rmsnorm": (PTR, I64, I64, I64, PTR, F32, I64, I64, PTR, I64),
    "dasc_fused_simd": (),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "cpu_fused", _SIGNATURES, "the fused CPU activation kernels",
                        flags=("-fopenmp",),
                        returns={"dasc_fused_simd": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the AVX-512 forms run here.  Without them the kernels decline: their portable
    forms (a scalar exponential) are references for the tests, slower than torch."""
    return simd_probe(native_library(), "dasc_fused_simd")


def _runs(dim: int, simd: bool, *tensors: torch.Tensor) -> bool:
    return kernel_runs(native_library, simd_available, dim, simd, *tensors)


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
    out = torch.empty(rows.shape[0], dim, dtype=x.dtype)
    native_library().dasc_rmsnorm(rows.data_ptr(), rows.stride(0), rows.shape[0], dim,
                                  weight.data_ptr(), eps, int(x.dtype == torch.bfloat16),
                                  int(round_first), out.data_ptr(), int(simd))
    return out if x.dim() == 2 else out.view(*x.shape)
