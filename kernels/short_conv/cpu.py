"""The short convolution in C on a CPU (``cpu.c`` beside this file), with the bits of the torch
forms it stands in for (``naive.py``): ``conv_in_place`` decodes one token per sequence, each
state shifted in place in its slot; ``conv_window_sums`` computes a prefill chunk's window sums.
Each returns None where it does not run (no C compiler, ``DASC_NATIVE_KERNELS=0``, tensors not
on the CPU or not of the dtypes and layouts it reads, autograd), and the caller takes the torch
form.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import I64, PTR, check_slots, enabled, load_library

SOURCE = Path(__file__).with_name("cpu.c")
_SIGNATURES = {
    "dasc_conv_decode": (PTR, I64, PTR, I64, I64, I64, PTR, I64, PTR, PTR, I64),
    "dasc_conv_prefill": (PTR, I64, PTR, I64, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, I64),
}


@cache
def native_library() -> ctypes.CDLL | None:
    return load_library(SOURCE, "short_conv", _SIGNATURES, "the CPU short convolution",
                        flags=("-fopenmp",))


def _conv_runs(x: torch.Tensor, columns: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the conv kernels read these: CPU tensors, x [N, C] with unit-stride rows and
    states [..., C, width] of one dtype, bf16 or FP32, contiguous FP32 taps [width + 1, C],
    no autograd, the library built and switched on."""
    channels, width = states.shape[-2:]
    return (x.device.type == states.device.type == "cpu" and states.dtype == x.dtype
            and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
            and x.dim() == 2 and x.stride(1) == 1 and columns.dtype == torch.float32
            and columns.is_contiguous() and tuple(columns.shape) == (width + 1, channels)
            and enabled() and native_library() is not None)


def conv_in_place(x: torch.Tensor, columns: torch.Tensor, pool: torch.Tensor, slots: list[int]
                  ) -> torch.Tensor | None:
    """The window sums [B, C] FP32 of x [B, C] after the states ``pool[slots[b]]``
    ([S, C, width], bf16 or FP32 as x), each state shifted by x in place; ``columns``
    [width + 1, C] FP32 are the taps.  None where the kernel does not run."""
    num_slots, channels, width = pool.shape
    if (not _conv_runs(x, columns, pool) or not pool[0].is_contiguous()
            or pool.stride(0) < channels * width):
        return None
    index = check_slots(slots, num_slots)
    out = torch.empty(len(slots), channels)
    native_library().dasc_conv_decode(
        pool.data_ptr(), pool.stride(0), index.data_ptr(), len(slots), channels, width,
        x.data_ptr(), x.stride(0), columns.data_ptr(), out.data_ptr(),
        int(pool.dtype == torch.bfloat16))
    return out


def conv_window_sums(x: torch.Tensor, columns: torch.Tensor, states: torch.Tensor,
                     cu_seqlens: list[int], dtype: torch.dtype) -> torch.Tensor | None:
    """The window sums [N, C] of packed sequences, rounded to ``dtype`` (FP32 or bf16, where
    ``conv_varlen`` rounds them): sequence i is rows [cu_seqlens[i], cu_seqlens[i + 1]) of
    x [N, C] after ``states[i]`` ([B, C, width], bf16 or FP32 as x); ``columns``
    [width + 1, C] FP32 are the taps.  None where the kernel does not run."""
    num_seqs, channels, width = states.shape
    if (not _conv_runs(x, columns, states) or not states.is_contiguous()
            or dtype not in (torch.float32, torch.bfloat16) or len(cu_seqlens) != num_seqs + 1
            or cu_seqlens[0] != 0 or cu_seqlens[-1] != x.shape[0]
            or any(a > b for a, b in zip(cu_seqlens, cu_seqlens[1:]))):
        return None
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    out = torch.empty(x.shape[0], channels, dtype=dtype)
    rounded = dtype == torch.bfloat16
    scratch = torch.empty(channels if rounded else 0)
    native_library().dasc_conv_prefill(
        x.data_ptr(), x.stride(0), states.data_ptr(), channels * width, cu.data_ptr(), num_seqs,
        channels, width, columns.data_ptr(), None if rounded else out.data_ptr(),
        out.data_ptr() if rounded else None, scratch.data_ptr(), int(x.dtype == torch.bfloat16))
    return out
