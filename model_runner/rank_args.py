"""A rank flag's value as the runner takes it (dasc-serve's ranks, the runner benchmark); the
flags themselves are declared with the rest of dasc-serve's in ``dasc_server.flags``."""

from __future__ import annotations

from scheduler.wire.serve_config import Fp32Weights

FP32_WEIGHTS = tuple(Fp32Weights)


def fp32_weights(choice: str) -> bool | None:
    """``--cpu-fp32-weights`` as ``RunnerConfig.fp32_weights`` (None: auto)."""
    return {"auto": None, "on": True, "off": False}[choice]
