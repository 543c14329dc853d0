"""What this CPU does natively, where it changes which dtype is fast."""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without either, oneDNN emulates bf16 GEMMs (6x slower than fp32 on
    the AVX2 machines measured in docs/results/runner.md).  Read from /proc/cpuinfo where there
    is one (the launchers decide the dtype before they import torch), else asked of torch."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return any(flag in line.split() for flag in BF16_FLAGS)
    except OSError:
        pass
    import torch

    caps = torch.cpu.get_capabilities()
    return any(caps.get(flag) for flag in BF16_FLAGS)


def emulated_bf16_note(device: str, dtype: str, fp32_weights: str = "auto") -> str | None:
    """A one-line note for a user who asked for bf16 on a CPU that only emulates it."""
    if device != "cpu" or dtype != "bfloat16" or cpu_has_native_bf16():
        return None
    if fp32_weights != "off":
        return ("note: bfloat16 is emulated on this CPU (no AVX512-BF16, no AMX): GEMMs run "
                "in fp32 on packed fp32 copies of the large weights (--cpu-packed-weights) and "
                "the small weights held in fp32 (--cpu-fp32-weights), at up to 2x the bf16 "
                "weights' memory on top")
    return ("note: bfloat16 is emulated on this CPU (no AVX512-BF16, no AMX): its GEMMs run "
            "several times slower than float32 here; --dtype float32 is faster on this machine")
