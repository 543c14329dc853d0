"""Shared test setup.

transformers binds fla's Triton kernels when its Qwen3-Next / Kimi-Linear modules are imported and
fla is importable; on CPU those kernels fail, so the references run with fla blocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny models issue thousands of small ops; with several threads on 2 shared cores the
# OpenMP barriers cost more than the work (torchrun ranks get OMP_NUM_THREADS=1 the same way).
torch.set_num_threads(1)

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def run_torchrun(nproc: int, script: Path, *args: str, timeout: float = 600.0
                 ) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` gloo ranks with real torchrun; raise with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{TESTS}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun x{nproc} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def torchrun():
    return run_torchrun
