"""Compile-on-first-use C libraries for the CPU paths (``ragged_state/native.c``,
``delta_rule/cpu_chunk.c``, ``delta_rule/cpu_decode.c``, ``short_conv/cpu.c``,
``cpu_fused/fused.c``, ``decode_attention/attention.c``, ``moe_decode/experts.c``,
``gemv/gemv.c``; all but the first two share ``cpu_simd.h``), loaded through ctypes.

A library is compiled with the system C compiler (`$CC`, else `cc`/`gcc`; well under a second)
into `$DASC_CACHE_DIR` (default `~/.cache/dasc`; a per-user temporary directory when that is
unusable), keyed by the source, the shared headers, the compiler and the flags.  Without a
compiler, or with `DASC_NATIVE_KERNELS=0`, ``load_library`` returns None and callers take
their torch path.
Built without -ffast-math and with -ffp-contract=off, so every operation rounds as written: a
fused multiply-add happens only where the source asks for one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

KERNELS = Path(__file__).parent  # the headers the sources include ("../cpu_simd.h")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-fno-fast-math", "-ffp-contract=off")
I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def _cache_dirs() -> list[Path]:
    """Where a library may be built: $DASC_CACHE_DIR, else the user cache; then a per-user
    temporary directory (a read-only or missing home)."""
    dirs = []
    if os.environ.get("DASC_CACHE_DIR"):
        dirs.append(Path(os.environ["DASC_CACHE_DIR"]))
    else:
        try:
            dirs.append(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dasc")
        except RuntimeError:  # no home directory to be found
            pass
    return dirs + [Path(tempfile.gettempdir()) / f"dasc-{os.getuid()}"]


_enabled = True


def set_enabled(on: bool) -> None:
    """Switch every native kernel off (the torch forms run) or back on in this process, e.g. to
    time both in one run (``runner_speed --native-kernels alternate``)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def simd_probe(lib: ctypes.CDLL | None, fn: str) -> bool:
    """Whether a loaded library's AVX-512 forms run on this CPU (its ``fn`` returns 1)."""
    return lib is not None and bool(getattr(lib, fn)())


def kernel_runs(library, simd_available, dim: int, simd: bool, *tensors) -> bool:
    """A kernel with an AVX-512 form runs on CPU tensors without autograd, its library built
    (``library()``), in the AVX-512 form (rows of a multiple of 16 on a CPU where
    ``simd_available()``) unless ``simd`` is False (tests take the portable form)."""
    return (runs_here(*tensors) and library() is not None
            and (not simd or (dim % 16 == 0 and simd_available())))


def runs_here(*tensors) -> bool:
    """Whether a native kernel may take these tensors: on the CPU, autograd off, native kernels
    switched on (each kernel adds its own library, dtype and layout checks)."""
    import torch

    return (_enabled and not torch.is_grad_enabled()
            and all(t.is_cpu for t in tensors))


def _build(source: Path, name: str, compiler: list[str], cache_dir: Path,
           flags: tuple[str, ...]) -> Path:
    """Compile once per (source, flags, compiler, machine); concurrent builders (several ranks)
    each write a temporary file and rename it into place."""
    flags = (*FLAGS, *flags)
    headers = b"".join(h.read_bytes() for h in sorted(KERNELS.glob("*.h")))  # cpu_simd.h
    key = hashlib.sha256(source.read_bytes() + headers + " ".join((*compiler, *flags)).encode())
    target = cache_dir / f"{name}-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-o", tmp, str(source), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, name: str, signatures: dict[str, tuple], what: str,
                 flags: tuple[str, ...] = (), returns: dict[str, type] | None = None
                 ) -> ctypes.CDLL | None:
    """``source`` compiled (with ``flags`` beside the common ones) and loaded, each function of
    ``signatures`` typed (argument types; the return type from ``returns``, else none), or None
    (disabled, no compiler, or the build failed: warned, naming ``what`` falls back to
    torch)."""
    if os.environ.get("DASC_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [
        c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler:
        return None
    errors = []
    for cache_dir in _cache_dirs():
        try:
            lib = ctypes.CDLL(str(_build(source, name, compiler, cache_dir, flags)))
            break
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(getattr(exc, "stderr", "") or exc).strip())
    else:
        warnings.warn(f"dasc: {what} not built ({'; '.join(errors)}); using torch",
                      stacklevel=3)
        return None
    for fn_name, argtypes in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, (returns or {}).get(fn_name)
    return lib


def check_slots(slots: list[int], num_slots: int) -> torch.Tensor:
    """``slots`` as an int64 tensor for a kernel that indexes a pool of ``num_slots`` with them
    unchecked; raises IndexError for one outside it."""
    if slots and (min(slots) < 0 or max(slots) >= num_slots):  # the C code trusts them
        raise IndexError(f"state slots {slots} outside [0, {num_slots})")
    return torch.tensor(slots, dtype=torch.long)
