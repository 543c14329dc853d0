"""Real dasc-serve processes for tests (``dasc_server.spawn``) and the built-in model paths."""

from __future__ import annotations

from dasc_server.spawn import ROOT, Server, running_server

ASSETS = ROOT / "model_runner" / "assets"
KIMI, QWEN = ASSETS / "kimi-linear-tiny", ASSETS / "qwen3-next-tiny"

__all__ = ["KIMI", "QWEN", "Server", "running_server"]
