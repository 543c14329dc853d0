"""Start a real dasc-serve in the background (tests, benchmarks, the load generator).

``running_server(*flags)`` starts ``python -m dasc_server.launch --port <free> *flags`` in a new
session, waits for its ready line and ``/health``, yields a ``Server`` and, whatever happens,
kills every process it started on exit: the launcher's process group (launcher, scheduler,
torchrun) and the ranks, which torchrun starts in sessions of their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"dasc-serve ready: (http://\S+)")


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: str | list[int], max_tokens: int = 8, **extra) -> dict:
        """Non-streaming greedy completion with token ids; raises on an HTTP error."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **extra}
        r = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()

    def flush(self) -> None:
        httpx.post(f"{self.base_url}/flush_cache", timeout=60).raise_for_status()

    def stats(self) -> dict:
        r = httpx.get(f"{self.base_url}/v1/stats", timeout=60)
        r.raise_for_status()
        return r.json()


@contextmanager
def running_server(*flags: str, timeout: float = 300.0,
                   wrap: tuple[str, ...] = ()) -> Iterator[Server]:
    """``wrap``: a command that execs the launcher's command line given as its arguments (e.g.
    ``unshare ... sh -c '...; exec "$@"' sh``), so its pid stays the launcher's."""
    log = tempfile.NamedTemporaryFile("w+", prefix="dasc-serve-", suffix=".log", delete=False)
    # --port 0: the launcher binds a free port itself and names it in its ready line (a port
    # chosen here would be free, and takeable, until the launcher binds it)
    cmd = [*wrap, sys.executable, "-m", "dasc_server.launch", "--port", "0", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    server = Server("", proc, Path(log.name))
    try:
        _wait_ready(server, timeout)
        yield server
    finally:
        _kill_group(proc)
        log.close()
        os.unlink(log.name)


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"dasc-serve exited with {server.proc.returncode}:\n"
                                 f"{server.log()[-4000:]}")
        ready = READY.search(server.log())
        if ready:
            server.base_url = ready.group(1)
            try:
                if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"dasc-serve not ready after {timeout:.0f} s:\n{server.log()[-4000:]}")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its children in order, as for a user's stop), then
    SIGKILL whatever is left of its process group and of the processes it started."""
    below = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
