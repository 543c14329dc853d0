"""CPU prefill of the gated delta rule with one log-decay per head (GDN) in C
(``cpu_chunk.c`` beside this file): chunk by chunk, each state advanced in place in its pool
slot, so a step's states are neither gathered nor written back.

The torch form and reference is ``kernels/delta_rule/naive.py``'s ``chunk_delta_rule``; the
two agree to FP32 rounding (tests/kernels/test_cpu_chunk_native.py: ~1e-6 of the outputs' scale over
hundreds of tokens).  ``chunk_in_pool`` returns None where the kernel does not run (no C
compiler, ``DASC_NATIVE_KERNELS=0``, a CPU without AVX-512, a per-channel decay, tensors not
FP32 on the CPU, autograd), and the caller takes the torch form.

``bf16=True`` (a bf16 model's prefill) takes the kernel's AMX form where ``amx_runs``: its
chunk products from bf16-rounded operands with FP32 accumulation (``cpu_chunk.c``'s header), at
~1.6x the FP32 form's speed at Qwen3.5's GDN shape on one core and within bf16 rounding of it;
tests/kernels/test_cpu_chunk_amx.py checks it against a float64 emulation of the same roundings.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import F32, I64, PTR, enabled, load_library

SOURCE = Path(__file__).with_name("cpu_chunk.c")
_SIGNATURES = {"dasc_gdn_chunk": (PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64,
                                  I64, I64, F32, I64, PTR, I64, I64, I64),
               "dasc_gdn_chunk_simd": (), "dasc_gdn_chunk_amx": ()}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "cpu_chunk", _SIGNATURES, "the CPU chunked delta rule",
                        flags=("-fopenmp",), returns={"dasc_gdn_chunk": ctypes.c_int,
                                                      "dasc_gdn_chunk_simd": ctypes.c_int,
                                                      "dasc_gdn_chunk_amx": ctypes.c_int})


@cache
def simd_available() -> bool:
    """Whether the kernel's AVX-512 form runs here.  Without it the kernel declines: its
    portable form (scalar fused multiply-adds) is a reference for the tests, slower than the
    torch form."""
    lib = native_library()
    return lib is not None and bool(lib.dasc_gdn_chunk_simd())


_amx_on = True


def set_amx(on: bool) -> None:
    """Let ``amx_runs`` say yes where AMX is here, or never (benchmarks time both forms in one
    process: ``runner_speed --delta-rule-amx``)."""
    global _amx_on
    _amx_on = on


def amx_runs(k_dim: int, v_dim: int) -> bool:
    """Whether a bf16 model's prefill with these head dims takes the AMX products:
    ``amx_available()``, K and V multiples of 32 (the tiles' depth), and not switched off by
    ``set_amx``."""
    return _amx_on and k_dim % 32 == 0 and v_dim % 32 == 0 and amx_available()


@cache
def amx_available() -> bool:
    """Whether the kernel's bf16 products run on AMX here (``chunk_in_pool(bf16=True)``): a CPU
    with AMX-BF16 and AVX512-BF16, and Linux granting the process the tile state."""
    lib = native_library()
    return lib is not None and bool(lib.dasc_gdn_chunk_amx())


def chunk_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, simd: bool = True) -> bool:
    """Whether ``chunk_in_pool`` runs on these operands (its pool aside), so a caller can skip
    preparing a pool for it: a per-head decay, FP32 CPU tensors, no autograd, the library
    built and switched on, its AVX-512 form here (unless ``simd`` is False: tests)."""
    return (g.dim() == 2 and not torch.is_grad_enabled()
            and all(x.dtype == torch.float32 and x.device.type == "cpu"
                    for x in (q, k, v, g, beta))
            and enabled() and native_library() is not None
            and (not simd or simd_available()))


def chunk_in_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, pool: torch.Tensor, slots: list[int],
                  cu_seqlens: list[int], scale: float, chunk_size: int, simd: bool = True,
                  bf16: bool = False) -> torch.Tensor | None:
    """Sequence i (rows [cu_seqlens[i], cu_seqlens[i + 1]) of q, k [N, Hk, K], v [N, H, V],
    g, beta [N, H]) runs from and into ``pool[slots[i]]`` ([S, H, K, V] FP32).  Returns
    o [N, H, V] FP32, or None where the kernel does not run.  ``simd=False`` takes the portable
    loops (tests).  ``bf16``: the chunk's products on AMX from bf16-rounded operands (the C
    source's header) where ``amx_runs(K, V)`` would say so; elsewhere the FP32 form."""
    num_heads, k_dim, v_dim = pool.shape[1:]
    operands = (q, k, v, g, beta)
    if (not chunk_runs(*operands, simd=simd) or pool.device.type != "cpu"
            or pool.dtype != torch.float32 or not pool[0].is_contiguous()
            or pool.stride(0) < num_heads * k_dim * v_dim):
        return None
    if slots and (min(slots) < 0 or max(slots) >= pool.shape[0]):  # the C code trusts them
        raise IndexError(f"state slots {slots} outside [0, {pool.shape[0]})")
    q, k, v, g, beta = (x.contiguous() for x in operands)
    index = torch.tensor(slots, dtype=torch.long)
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    o = torch.empty(v.shape, dtype=torch.float32)
    status = native_library().dasc_gdn_chunk(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
        pool.data_ptr(), pool.stride(0), index.data_ptr(), cu.data_ptr(), len(slots),
        q.shape[1], num_heads, k_dim, v_dim, scale, chunk_size, o.data_ptr(),
        torch.get_num_threads(), int(simd), int(bf16))
    if status != 0:
        raise MemoryError("the CPU chunked delta rule could not allocate its scratch")
    return o
