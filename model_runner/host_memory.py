"""Keep freed host memory in the process instead of returning it to the OS.

glibc serves every allocation above its mmap threshold (128 KiB to 32 MiB, adaptive) with a
fresh ``mmap`` and unmaps it on free, so each large temporary of a CPU forward (activations,
attention scores, chunked delta-rule operands: 4-64 MB at real shapes) pays first-touch page
faults again.  On the VMs measured here that cost 3-5x the operation itself (a 32 MB ``mul``:
27 ms allocating, 6 ms reusing).  ``mallopt(M_MMAP_MAX, 0)`` keeps large blocks on the heap
and a high ``M_TRIM_THRESHOLD`` keeps freed heap memory, as tcmalloc or jemalloc would; a
rank's resident size then stays at its peak, which serving needs anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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
