"""A CPU rank's host memory: freed memory kept in the process, and huge pages for what a decode
step streams.

``keep_freed_memory``: glibc serves every allocation above its mmap threshold (128 KiB to
32 MiB, adaptive) with a fresh ``mmap`` and unmaps it on free, so each large temporary of a CPU
forward (activations, attention scores, chunked delta-rule operands: 4-64 MB at real shapes)
pays first-touch page faults again.  On the VMs measured here that cost 3-5x the operation
itself (a 32 MB ``mul``: 27 ms allocating, 6 ms reusing).  ``mallopt(M_MMAP_MAX, 0)`` keeps
large blocks on the heap and a high ``M_TRIM_THRESHOLD`` keeps freed heap memory, as tcmalloc
or jemalloc would; a rank's resident size then stays at its peak, which serving needs anyway.

``move_to_huge_pages``: the weights a decode step streams in transparent huge pages (the
comment at ``HUGE_PAGE``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


def return_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``), once start-up
    has freed what it copied or dropped (weights moved into huge pages, weights their copies
    stand in for): ``keep_freed_memory`` would otherwise keep them resident for good.  The
    step's temporaries that reuse those pages fault them in once.  Returns whether it ran."""
    if os.environ.get("DASC_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


# Transparent huge pages (2 MiB) for the weights a decode step streams.  With 4 KiB pages a
# step's 0.4-1.5 GB of weights take a TLB miss every 64 cache lines, and on a VM each miss walks
# two page tables; in huge pages a runner decode step got 3-9 % faster at both bench shapes
# (docs/benchmarks.md, "Huge pages for what a decode step streams").  Most kernels give huge
# pages only to memory that asks (/sys/kernel/mm/transparent_hugepage/enabled: madvise), before
# its first touch: so the weights are copied into anonymous mappings advised MADV_HUGEPAGE.  The
# copy is start-up time: the kernel may first compact memory for each huge page (~110-250 MB/s
# on the 2-core VM measured), so the input embedding, whose rows a step reads a few of, stays
# where it is, and so do the KV pool and the state slots (no faster in huge pages).  Where the
# kernel has no huge page to give, the memory is ordinary; the bits are copied as they are.
HUGE_PAGE = 2 << 20
MIN_MOVE_BYTES = HUGE_PAGE  # smaller storages stay where they are


def huge_pages_enabled() -> bool:
    """Whether Python's mmap can advise huge pages here (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8, untouched, in a private anonymous mapping advised MADV_HUGEPAGE and
    starting on a 2 MiB boundary (the mapping lives as long as the tensor's storage)."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    area.madvise(mmap.MADV_HUGEPAGE)  # the whole mapping: its aligned 2 MiB spans qualify
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy every CPU storage of at least ``MIN_MOVE_BYTES`` behind ``tensors`` into huge pages and
    point each of those tensors at the copy (views keep their offsets and strides, tensors that
    share a storage, such as tied embeddings, still share one).  A tensor not passed in that
    shares such a storage keeps the old one alive: pass every holder.  Returns the bytes
    moved; 0 where mmap cannot advise huge pages."""
    if not huge_pages_enabled():
        return 0
    holders: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    seen: set[int] = set()  # a tensor listed twice (a tied weight's two modules) moves once
    for t in tensors:
        if storage_ptr(t) is None or id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        if storage.nbytes() >= MIN_MOVE_BYTES:
            holders.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    moved = 0
    for storage, users in holders.values():
        copy = huge_page_bytes(storage.nbytes())
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        # base: bytes into the mapping, a multiple of its 4 KiB alignment, so of any element size
        target, base = copy.untyped_storage(), copy.storage_offset()
        with torch.no_grad():
            for u in users:
                u.set_(target, base // u.element_size() + u.storage_offset(), u.size(), u.stride())
        moved += storage.nbytes()
    return moved


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of a CPU tensor's storage; None for other devices and layouts (oneDNN's
    packed weights are opaque)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
        return None
    return t.untyped_storage().data_ptr()


def decode_streamed(model: torch.nn.Module, embedding: torch.nn.Module,
                    coded: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """``module_tensors(model)`` but those only the input embedding holds: a storage that a
    module outside it holds too (a tied LM head) is streamed.  A module with a coded copy of
    its weights (``linear.code_gemms``) streams that copy instead: the weights it stands in
    for (the module's ``CODED_WEIGHTS``) are left out, and the copies' tensors ``coded`` are
    added."""
    inside = {id(m) for m in embedding.modules()}

    def coded_away(m: torch.nn.Module, t: torch.Tensor) -> bool:
        return getattr(m, "coded", None) is not None and any(
            t is getattr(m, name, None) for name in getattr(m, "CODED_WEIGHTS", ()))

    streamed = {storage_ptr(t) for m in model.modules() if id(m) not in inside
                for t in _own_tensors(m) if not coded_away(m, t)}
    return [t for t in module_tensors(model) if storage_ptr(t) in streamed] + list(coded)


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers and tensor attributes, also inside
    lists, tuples and dicts (a layer's per-expert weights)."""
    return [t for m in module.modules() for t in _own_tensors(m)]


def _own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
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

    for value in vars(module).values():
        visit(value, 0)
    return found
