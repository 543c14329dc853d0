"""Tensor-parallel group: rank, size and the three collectives the model needs.

Passed explicitly to every parallel layer (no global singleton). With size 1 every collective is
the identity and torch.distributed is never touched, so single-process use needs no launcher.
On CPU, ranks on one host all-reduce and all-gather small tensors through shared memory
(``shm_collectives``: gloo costs ~2 ms a call there); larger ones, and every broadcast, go
through torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_runner.shm_collectives import ShmCollectives, shm_collectives


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    shm: ShmCollectives | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped shards along the last dim, in rank order."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather_last(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's object on every rank (typed messages from the driver to the other ranks)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def rank_device(name: str) -> torch.device:
    """The device this rank runs on: on CUDA the GPU of its ``LOCAL_RANK`` (torchrun), made
    current."""
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def init_tp_group(device: torch.device) -> TPGroup:
    """Join the torchrun world (gloo on CPU, NCCL on CUDA); a plain process is a group of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return TPGroup()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    shm = shm_collectives(rank, size) if device.type == "cpu" else None
    return TPGroup(rank=rank, size=size, shm=shm)


def shutdown_tp_group(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
