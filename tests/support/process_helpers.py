"""Process-tree checks for the tests that stop dasc-serve: a process group still alive, the
children of a process (optionally those running a given command), waiting until a group is
gone."""

from __future__ import annotations

import os
import subprocess
import time


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def children_running(pid: int, needle: str) -> list[int]:
    """Children of ``pid`` whose command line (NUL-separated) contains ``needle``."""
    return [p for p in children_of(pid) if needle in open(f"/proc/{p}/cmdline").read()]


def wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid), "a server process outlived dasc-serve"
