"""The ways a ``CheckpointPool`` moves state, one ``CheckpointBackend`` per module (``base``).

    triton      TritonBackend: CUDA (and strided) state, Triton kernels; the reference path
    native      NativeBackend: contiguous CPU state, the one-pass C library
    torch_flat  TorchFlatBackend: contiguous CPU state without the library, torch flat rows
"""

from __future__ import annotations

from model_runner.checkpoints.backends.interface import CheckpointBackend
from model_runner.checkpoints.backends.native import NativeBackend
from model_runner.checkpoints.backends.torch_flat import TorchFlatBackend
from model_runner.checkpoints.backends.triton import TritonBackend

__all__ = ["CheckpointBackend", "NativeBackend", "TorchFlatBackend", "TritonBackend"]
