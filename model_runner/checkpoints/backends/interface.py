"""The interface every checkpoint backend implements: one way of moving state for a pool."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CheckpointBackend(ABC):
    """Store and load for one ``CheckpointPool`` (``ckpt``) along one path: Triton, the C
    library or torch flat rows.  All give the same bits; the pool picks one per call.

    Arguments, checked by the pool before any backend runs: pool, the active temporal state
    seen per unit ``[L, S, U_loc, D]`` fp32; conv, the active conv state
    ``[L, S, conv_dim_loc, k-1]``; src, dst ``[B]`` slot ids on the pool's device, B > 0, dst
    distinct.  With a balancing placement both calls are collectives over the pool's group.
    ``ckpt`` is not typed: importing the pool here would make the modules import each other.
    """

    def __init__(self, ckpt):
        self.ckpt = ckpt  # the CheckpointPool: buffers, index, runs and shared helpers

    @abstractmethod
    def store(self, pool: torch.Tensor, conv: torch.Tensor, src: torch.Tensor,
              dst: torch.Tensor) -> None:
        """Active slots src -> checkpoint slots dst: retained units packed (and quantised as
        the format asks), conv state whole."""

    @abstractmethod
    def load(self, pool: torch.Tensor, conv: torch.Tensor, src: torch.Tensor,
             dst: torch.Tensor) -> None:
        """Checkpoint slots src -> active slots dst: retained units restored, omitted units
        zero, conv state whole."""
