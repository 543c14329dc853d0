"""A CPU rank's host memory: freed memory kept in the process, and huge pages for what a decode
step streams.

``keep_freed_memory``: glibc serves every allocation above its mmap threshold (128 KiB to
32 MiB, adaptive) with a fresh ``mmap`` and unmaps it on free, so each large temporary of a CPU
forward (activations, attention scores, chunked delta-rule operands: 4-64 MB at real shapes)
pays first-touch page faults again.  On the VMs measured here that cost 3-5x the operation
itself (a 32 MB ``mul``: 27 ms allocating, 6 ms reusing).  ``mallopt(M_MMAP_MAX, 0)`` keeps
large blocks on the heap and a high ``M_TRIM_THRESHOLD`` keeps freed heap memory, as tcmalloc
or jemalloc would; a rank's resident size then stays at its peak, which serving needs anyway.

``move_to_huge_pages`` and ``host_zeros``: the weights, the KV pool and the state slots in
transparent huge pages (the comment at ``HUGE_PAGE``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
from collections.abc import Iterable

import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
_done = False


def keep_freed_memory() -> bool:
    """Apply once per process (glibc only; ``DASC_KEEP_FREED_MEMORY=0`` disables).  Returns
    whether the allocator was tuned."""
    global _done
    if _done:
        return True
    if os.environ.get("DASC_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _done


# Transparent huge pages (2 MiB) for the memory a decode step streams: the weights, the KV pool
# and the recurrent-state slots.  With 4 KiB pages a step's ~0.4-1.5 GB of weights take a TLB
# miss every 64 cache lines, and on a VM each miss walks two page tables; 2 MiB pages made the
# C GEMV stream 14.0 -> 15.4 GB/s and a runner decode step (two sequences at 1,400 tokens) 7-9 %
# faster at both bench shapes (docs/benchmarks.md, "Huge pages").  Most kernels leave huge
# pages to processes that ask (/sys/kernel/mm/transparent_hugepage/enabled: madvise), and a page
# is huge only if it is asked for before its first touch: so these tensors live in anonymous
# mappings advised MADV_HUGEPAGE before anything is written to them.  Where the kernel gives no
# huge pages they are ordinary memory; nothing else changes (the bits are copied as they are).
HUGE_PAGE = 2 << 20


def huge_pages_enabled() -> bool:
    """Off with ``DASC_HUGE_PAGES=0``, and where Python's mmap cannot advise huge pages."""
    return (os.environ.get("DASC_HUGE_PAGES", "1") != "0"
            and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE"))


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8, untouched, in a private anonymous mapping advised MADV_HUGEPAGE and
    starting on a 2 MiB boundary (the mapping lives as long as the tensor's storage)."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE or HUGE_PAGE)
    return whole[start : start + nbytes]


def host_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in huge pages where they are enabled
    (written once, so its pages are faulted in now, as torch.zeros's are)."""
    if not huge_pages_enabled():
        return torch.zeros(*shape, dtype=dtype)
    numel = math.prod(shape)
    out = huge_page_bytes(numel * dtype.itemsize).view(dtype).view(*shape)
    return out.zero_()


def move_to_huge_pages(tensors: Iterable[torch.Tensor], min_bytes: int = HUGE_PAGE) -> int:
    """Copy every CPU storage of at least ``min_bytes`` behind ``tensors`` into huge pages and
    point each of those tensors at the copy (views keep their offsets and strides, tensors that
    share a storage, such as tied embeddings, still share one).  A tensor not passed in that
    shares such a storage keeps the old one alive: pass every holder.  Returns the bytes
    moved; 0 where huge pages are off."""
    if not huge_pages_enabled():
        return 0
    holders: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() >= min_bytes:
            holders.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    moved = 0
    for storage, users in holders.values():
        if any(u.element_size() != users[0].element_size() for u in users):
            continue  # offsets in elements of different sizes: leave it
        copy = huge_page_bytes(storage.nbytes())
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        target, base = copy.untyped_storage(), copy.storage_offset()
        with torch.no_grad():
            for u in users:
                u.set_(target, base // u.element_size() + u.storage_offset(), u.size(), u.stride())
        moved += storage.nbytes()
    return moved


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers and tensor attributes, also inside
    lists, tuples and dicts (a layer's per-expert weights)."""
    found: list[torch.Tensor] = []

    def visit(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    for m in module.modules():
        for value in vars(m).values():
            visit(value, 0)
    return found
