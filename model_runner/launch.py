"""Self-launch under torchrun: a command asked for ``--tp N`` re-runs itself on N ranks."""

from __future__ import annotations

import os
import subprocess
import sys


def is_rank_process() -> bool:
    return "WORLD_SIZE" in os.environ


def relaunch(tp: int, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` on ``tp`` ranks with ``torchrun --standalone``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", module, *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def is_first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"
