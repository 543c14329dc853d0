"""All-reduce and all-gather of small CPU tensors through shared memory, for ranks on one host.

Why: on CPU the ranks' collectives go through gloo, and on the machines measured here a gloo
all-reduce of a few hundred floats costs ~2 ms (a broadcast ~0.25 ms), while a decode step
makes two per layer.  Ranks on one host can instead exchange through one shared mapping:

- each rank copies its tensor into its own slot, then publishes the call's sequence number;
- it waits until every rank has published that number, then reads all slots and combines
  them in rank order, so every rank computes the same bits;
- slots alternate between two buffers (by call parity): a rank can only publish call k + 1
  after it has finished reading call k, so when call k + 2 reuses a buffer, nobody reads it.

The publish/read order relies on x86's total store order (data stores become visible before the
flag store that follows them), so this path is used on x86-64 only.  Tensors larger than a slot
go through gloo as before.  The wait spins, yielding the core after a short while, and gives up
with an error as soon as a peer it waits for has exited (each rank's pid sits beside its flag),
or after ``TIMEOUT_S``.  ``DASC_SHM_COLLECTIVES=0`` turns it off.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20  # per rank and buffer: a decode step's activations and logit shards fit
FLAG_STRIDE = 8  # int64s between two ranks' flags: one 64-byte cache line each
TIMEOUT_S = 300.0
SPINS_BEFORE_YIELD = 200


class ShmCollectives:
    def __init__(self, rank: int, size: int, mapping: mmap.mmap, slot_bytes: int):
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        header = size * FLAG_STRIDE * 8
        self._flags = memoryview(mapping)[:header].cast("q")
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=header,
                                count=2 * size * slot_bytes)
        self._slots = data.view(2, size, slot_bytes)
        self._calls = 0
        self._flags[rank * FLAG_STRIDE + 1] = os.getpid()  # read by a peer's _wait

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place, like ``dist.all_reduce``: the sum over ranks, added in rank order."""
        parts = self._exchange(x)
        out = x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
        flat = out.view(-1)
        flat.copy_(parts[0])
        for part in parts[1:]:
            flat.add_(part)
        if out is not x:
            x.copy_(out)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Equal-shaped shards concatenated along the last dim, in rank order."""
        parts = self._exchange(x)
        return torch.cat([p.view(x.shape) for p in parts], dim=-1)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x``, wait for every rank's, and return views of all of them (valid until
        the call after next)."""
        self._calls += 1
        call = self._calls
        nbytes = x.numel() * x.element_size()
        slots = self._slots[call & 1, :, :nbytes].view(x.dtype)  # [size, numel]
        slots[self.rank].copy_(x.reshape(-1))
        self._flags[self.rank * FLAG_STRIDE] = call
        self._wait(call)
        return list(slots.unbind(0))

    def _wait(self, call: int) -> None:
        flags, stride = self._flags, FLAG_STRIDE
        spins, deadline = 0, None
        while any(flags[r * stride] < call for r in range(self.size)):
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if deadline is None:
                deadline = time.monotonic() + TIMEOUT_S
            elif spins % 1000 == 0:
                for r in range(self.size):
                    pid = flags[r * stride + 1]
                    if flags[r * stride] < call and pid and not _alive(pid):
                        raise RuntimeError(f"rank {self.rank}: rank {r} exited during "
                                           f"shared-memory collective {call}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank}: a peer did not reach shared-memory "
                                       f"collective {call} within {TIMEOUT_S:.0f} s")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (an exited one not yet reaped is a zombie, 'Z')."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def shm_collectives(rank: int, size: int, slot_bytes: int = SLOT_BYTES
                    ) -> ShmCollectives | None:
    """Set up the shared mapping for the gloo world (a collective call: every rank calls it),
    or None where the path does not apply: turned off, not x86-64, no /dev/shm, or ranks on
    more than one host."""
    wanted = os.environ.get("DASC_SHM_COLLECTIVES", "1") != "0"
    usable = wanted and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")
    hosts: list = [None] * size
    dist.all_gather_object(hosts, (socket.gethostname(), usable))
    if not all(ok for _, ok in hosts) or len({h for h, _ in hosts}) != 1:
        return None
    nbytes = size * FLAG_STRIDE * 8 + 2 * size * slot_bytes
    box = [f"/dev/shm/dasc-tp-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    if rank == 0:
        with open(path, "wb") as f:
            f.truncate(nbytes)  # zero-filled: every flag starts at call 0
    dist.barrier()
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), nbytes)
    dist.barrier()
    if rank == 0:
        os.unlink(path)  # the mappings stay; nothing is left behind when the ranks exit
    return ShmCollectives(rank, size, mapping, slot_bytes)
