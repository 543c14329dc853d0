"""A rank flag's value as the runner takes it (dasc-serve's ranks, the runner benchmark); the
flags themselves are declared with the rest of dasc-serve's in ``dasc_server.flags``."""

from __future__ import annotations

FP32_WEIGHTS = ("auto", "on", "off")


def fp32_weights(choice: str) -> bool | None:
    """``--cpu-fp32-weights`` as ``RunnerConfig.fp32_weights`` (None: auto)."""
    return {"auto": None, "on": True, "off": False}[choice]
