"""Process start and end: a command asked for ``--tp N`` re-runs itself on N ranks under
torchrun; a server process that has stopped cleanly exits without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys


def is_rank_process() -> bool:
    return "WORLD_SIZE" in os.environ


def relaunch(tp: int, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` on ``tp`` ranks with ``torchrun --standalone``.

    Ranks print results on stdout (passed through).  When a rank failed with a one-line
    ``error:`` message, only that line is shown instead of torchrun's failure report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", module, *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if proc.returncode != 0 and errors:
        print(errors[0], file=sys.stderr)
    elif proc.stderr:
        print(proc.stderr, end="", file=sys.stderr)
    return proc.returncode


def is_first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def exit_now(code: int) -> None:
    """Flush and end the process with ``code``, skipping the interpreter's teardown: with torch
    (and transformers) loaded that takes ~1 s on every stop of every rank and of the launcher.
    Only for a process that has already released what others could see: sockets closed,
    children reaped, its process group left (shared memory is unlinked when it is mapped)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
