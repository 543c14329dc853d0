"""Per-rank memory: the paged KV pool of full-attention layers and the active recurrent-state slots.

KV pool, per full-attention layer: ``[num_pages * page_size + 1, *entry_shape]``; row
``page * page_size + offset`` holds one token.  Page ids are chosen by the driver (scheduler) from
``[0, num_pages)``; the last row (``scratch_row``) belongs to no page: padded sequences of a
static decode batch write their KV there and read only it.

State pool, all linear layers in one tensor each (the checkpoint kernels index it as one pool):
    temporal [L, num_slots, H_loc, K, V]  FP32
    conv     [L, num_slots, conv_dim_loc, kernel - 1]  model dtype
Slot 0 is reserved as the padding/dummy slot and is never handed to a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVPool:
    def __init__(self, entry_shapes: list[tuple[int, ...]], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_row = num_pages * page_size
        rows = self.scratch_row + 1
        self.caches = [torch.zeros(rows, *shape, dtype=dtype, device=device)
                       for shape in entry_shapes]


@dataclass(slots=True)
class RequestState:
    """One request's recurrent state, all linear layers: conv [L, C, k-1], temporal [L, H, K, V]."""

    conv: torch.Tensor
    temporal: torch.Tensor

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[i], self.temporal[i]


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, num_heads: int, k_dim: int, v_dim: int,
                 conv_dim: int, conv_kernel: int, conv_dtype: torch.dtype, device: torch.device):
        if num_slots < 2:
            raise ValueError("the state pool needs at least 2 slots (slot 0 is reserved)")
        self.num_slots = num_slots
        self.temporal = torch.zeros(num_layers, num_slots, num_heads, k_dim, v_dim,
                                    dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1,
                                dtype=conv_dtype, device=device)

    def _check(self, slot: int) -> None:
        if not 0 < slot < self.num_slots:
            raise IndexError(f"state slot {slot} outside [1, {self.num_slots})")

    def read(self, slot: int) -> RequestState:
        self._check(slot)
        return RequestState(self.conv[:, slot].clone(), self.temporal[:, slot].clone())

    def write(self, slot: int, state: RequestState) -> None:
        self._check(slot)
        self.conv[:, slot].copy_(state.conv)
        self.temporal[:, slot].copy_(state.temporal)

    def zero(self, slot: int | torch.Tensor) -> None:
        self.conv[:, slot] = 0
        self.temporal[:, slot] = 0

    def copy(self, src: int, dst: int) -> None:
        self._check(src)
        self._check(dst)
        self.conv[:, dst].copy_(self.conv[:, src])
        self.temporal[:, dst].copy_(self.temporal[:, src])
