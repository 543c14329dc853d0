"""dasc-serve as one command: SIGTERM stops every process it started; a rank that dies ends
the server with a non-zero exit naming the ranks; bad arguments fail before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from serving import KIMI, running_server


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


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dasc-serve still running after {timeout} s")


def test_sigterm_stops_every_process_and_exits_zero():
    with running_server("--model", str(KIMI), "--tp", "2") as server:
        assert server.complete([65, 66, 67], max_tokens=2)["choices"][0]["token_ids"]
        assert len(children_of(server.proc.pid)) == 2  # scheduler + torchrun
        server.proc.send_signal(signal.SIGTERM)  # the launcher only, not its group
        assert wait_exit(server.proc, 20) == 0
        wait_group_gone(server.proc.pid)


def test_a_dead_rank_ends_the_server_with_an_error():
    with running_server("--model", str(KIMI)) as server:
        launcher = server.proc.pid
        ranks = children_running(launcher, "serve_rank")
        assert len(ranks) == 1
        started = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        assert wait_exit(server.proc, 10) != 0
        assert time.monotonic() - started < 10
        assert "error: the rank processes exited" in server.log()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_rank_failing_at_start_up_ends_the_server(tp):
    """A rank that fails before it connects (here: a budget that holds no checkpoint slot) must
    end dasc-serve with an error and a non-zero exit, not leave it waiting (issue 18)."""
    from scheduler.ipc import free_port

    cmd = [sys.executable, "-m", "dasc_server.launch", "--model", str(KIMI), "--tp", str(tp),
           "--port", str(free_port()), "--state-budget-bytes", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("dasc-serve hung after a rank failed at start-up")
    assert proc.returncode != 0
    assert "holds no checkpoint slot" in out and "error: the rank processes exited" in out
    wait_group_gone(proc.pid)


def test_a_dead_scheduler_ends_the_server_and_its_ranks():
    with running_server("--model", str(KIMI), "--tp", "2") as server:
        scheduler = children_running(server.proc.pid, "-m\0scheduler")
        assert len(scheduler) == 1
        started = time.monotonic()
        os.kill(scheduler[0], signal.SIGKILL)
        assert wait_exit(server.proc, 10) != 0
        assert time.monotonic() - started < 10
        log = server.log()
        assert "error: the scheduler exited" in log or "error: lost the scheduler" in log
        assert "Traceback" not in log  # the ranks stop in step, without a collective error
        wait_group_gone(server.proc.pid)


def test_bad_arguments_fail_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "dasc_server.launch", "--model", str(tmp_path), "--port", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "config.json" in proc.stderr
    proc = subprocess.run([*cmd[:-4], "--model", str(KIMI), "--tp", "3"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "error: " in proc.stderr
    for flags, message in ((["--tp", "0"], "--tp must be at least 1 (got 0)"),
                           (["--wmax", "-5"], "--wmax must be >= 0 (got -5.0)")):
        proc = subprocess.run([*cmd[:-4], "--model", str(KIMI), *flags], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message}"


def test_step_target_derives_the_prefill_budget_from_the_ranks_measurement():
    """--step-target-ms reaches the ranks, which time a prefill; the scheduler's budget is then
    above the 64-token floor that a missing measurement (rate 0) would give."""
    import httpx

    with running_server("--model", str(KIMI), "--step-target-ms", "2000") as server:
        info = httpx.get(server.base_url + "/server_info", timeout=30).json()
        assert info["chunked_prefill_size"] % 64 == 0 and info["chunked_prefill_size"] > 64
        assert server.complete([65, 66, 67], max_tokens=2)["choices"][0]["token_ids"]
