"""The scheduler process around the policy: it imports no torch, its prefill budget follows the
measured rate, the flags pick the chunk budget, its IPC connections send small frames at once,
it checks its books when it goes idle, not when a request wakes it, and after a step that
finished requests it waits ``batch_wait_ms`` for more prompts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from support.paths import ROOT
from support.serving import ipc_pair


def test_scheduler_imports_no_torch():
    """Every module of the scheduler package (its process entry point aside)."""
    modules = sorted(f"scheduler.{p.stem}" for p in (ROOT / "scheduler").glob("*.py")
                     if p.stem not in ("__init__", "__main__"))
    assert "scheduler.step_planner" in modules
    code = ("import sys\n"
            f"import scheduler, {', '.join(modules)}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_prefill_budget_follows_the_measured_rate():
    from scheduler.__main__ import prefill_budget

    # 1,000 tokens/s and a 250 ms step: 250 tokens, rounded down to 192 (multiples of 64)
    assert prefill_budget(1000.0, 250.0) == 192
    assert prefill_budget(4096.0, 250.0) == 1024
    assert prefill_budget(8000.0, 500.0) == 4000 // 64 * 64
    assert prefill_budget(10.0, 250.0) == 64  # never below one 64-token chunk
    assert prefill_budget(1e7, 250.0) == 8192  # nor above the cap


def test_ipc_connections_send_small_frames_at_once(monkeypatch):
    """Both ends of an engine connection set TCP_NODELAY (else Nagle holds tokens back),
    and a message still round-trips."""
    import os
    import socket

    from scheduler.wire import ipc
    from scheduler.wire.messages import Shutdown

    client, server = ipc_pair(monkeypatch)
    try:
        for conn in (server, client):
            with socket.socket(fileno=os.dup(conn.fileno())) as s:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        ipc.send(client, Shutdown())
        assert isinstance(ipc.recv(server), Shutdown)
    finally:
        server.close()
        client.close()


def test_chunk_budget_flags():
    """An explicit --chunked-prefill-size wins; --step-target-ms derives the budget from the
    rate rank 0 measured; neither keeps the default."""
    from dasc_server.flags import parse_args, serve_config
    from scheduler.__main__ import chunk_budget
    from scheduler.wire.rank_messages import RankInfo
    from scheduler.wire.serve_config import DEFAULT_CHUNKED_PREFILL

    info = RankInfo("qwen3_next", 1, 64, None, 4096, 4, 100, 100, 0, prefill_tokens_per_s=4096.0)

    def budget(*flags: str) -> int:
        return chunk_budget(serve_config(parse_args(list(flags))).scheduling, info)

    assert budget("--step-target-ms", "250") == 1024
    assert budget("--chunked-prefill-size", "300", "--step-target-ms", "250") == 300
    assert budget() == DEFAULT_CHUNKED_PREFILL == 2048


def test_an_inherited_listener_authenticates_like_a_listener(monkeypatch):
    """The launcher binds the scheduler's listening sockets and passes them down by fd
    (``ipc_pair`` connects the same way); a client with another key is refused."""
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from scheduler.wire import ipc
    from scheduler.wire.messages import StatsReq

    monkeypatch.setenv(ipc.AUTHKEY_ENV, ipc.new_authkey())
    sock = ipc.listening_socket()
    port, listener = sock.getsockname()[1], ipc.InheritedListener(sock.detach())
    refused: list = []

    def expect_refusal(connect) -> None:
        try:
            connect()
        except AuthenticationError as e:
            refused.append(e)

    # threads, so that a listener that skipped the handshake fails the test instead of hanging
    threads = [threading.Thread(target=expect_refusal, args=(listener.accept,), daemon=True),
               threading.Thread(target=expect_refusal, daemon=True, args=(
                   lambda: Client(("127.0.0.1", port), authkey=b"not the key"),))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(refused) == 2  # both ends saw the wrong key
    listener.close()
    client, server = ipc_pair(monkeypatch)  # the right key: a working connection
    ipc.send(client, StatsReq())
    assert isinstance(ipc.recv(server), StatsReq)
    client.close()
    server.close()


@contextmanager
def _scheduler_loop(monkeypatch, **scheduling):
    """A real ``SchedulerProcess`` over real IPC in a thread, rank 0 played by the test: yields
    (front end's connection, rank 0's connection, the list of integrity checks so far).
    ``scheduling``: more ``SchedulingConfig`` fields."""
    from scheduler.__main__ import SchedulerProcess
    from scheduler.limits import RankLimits
    from scheduler.scheduler import Scheduler
    from scheduler.wire import ipc
    from scheduler.wire.messages import Shutdown
    from scheduler.wire.serve_config import SchedulingConfig

    sched = Scheduler(SchedulingConfig(max_total_tokens=64, max_running_requests=2,
                                       **scheduling),
                      RankLimits(num_checkpoint_slots=2, max_context_len=64, vocab_size=32))
    checks: list[int] = []
    real_check = sched.check_integrity
    monkeypatch.setattr(sched, "check_integrity", lambda: (real_check(), checks.append(1)))
    front, front_end = ipc_pair(monkeypatch)
    rank, rank_end = ipc_pair(monkeypatch)
    loop = threading.Thread(target=SchedulerProcess(sched, rank_end, front_end).run, daemon=True)
    loop.start()
    try:
        yield front, rank, checks
        ipc.send(front, Shutdown())
        loop.join(10)
        assert not loop.is_alive()
    finally:
        for conn in (front, front_end, rank, rank_end):
            conn.close()


def _serve_one(front, rank, rid: str, checks: list[int]) -> int:
    """Send a one-token request, play rank 0 for its step and its checkpoint store; the number
    of checks that had run when its plan arrived."""
    from scheduler.wire import ipc
    from scheduler.wire.messages import GenerateReq, SamplingParams, TokenBatch
    from scheduler.wire.rank_messages import BatchPlan, StepResult

    ipc.send(front, GenerateReq(rid, [3, 4, 5], SamplingParams(max_tokens=1)))
    plan = ipc.recv(rank)
    checked = len(checks)
    assert isinstance(plan, BatchPlan) and plan.seqs
    ipc.send(rank, StepResult(plan.step_id, [7], 0.0, [0.0]))
    assert isinstance(ipc.recv(front), TokenBatch)
    while rank.poll(1.0):  # the finished request's checkpoint store, a step of its own
        plan = ipc.recv(rank)
        assert not plan.seqs and len(checks) == checked
        ipc.send(rank, StepResult(plan.step_id, [], 0.0))
    return checked


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_idle_check_runs_before_waiting_not_after_a_request_arrives(monkeypatch):
    """The integrity check runs once when the loop goes idle; a request that then arrives is
    planned with no check in between, and finishing it makes the loop check again."""
    with _scheduler_loop(monkeypatch) as (front, rank, checks):
        _wait_for(lambda: checks)
        time.sleep(0.6)  # past one idle poll (0.5 s): no second check while nothing happened
        assert len(checks) == 1
        assert _serve_one(front, rank, "a", checks) == 1, "checked before planning"
        _wait_for(lambda: len(checks) == 2)
        assert len(checks) == 2


def test_no_check_between_a_step_that_empties_the_server_and_the_next_request(monkeypatch):
    """Under load a step often finishes every running request (one-token answers) while the
    next ones are still in the front end.  The loop waits ``QUIET_S`` before it checks, so a
    request that follows within it is planned with no check in between (with ``QUIET_S`` long
    here, the test does not race the loop)."""
    import scheduler.__main__ as process

    monkeypatch.setattr(process, "QUIET_S", 30.0)
    with _scheduler_loop(monkeypatch) as (front, rank, checks):
        for rid in ("a", "b", "c"):
            assert _serve_one(front, rank, rid, checks) == 0, f"checked before planning {rid}"
        assert not checks


def _first_plan_rids(front, rank, gap_s: float) -> list[str]:
    """Send one-token prompts "b" and, ``gap_s`` later, "c"; the rids of the first plan that
    carries sequences.  Every plan is answered (one token per sampled sequence) until the loop
    goes quiet, so both requests finish."""
    from scheduler.wire import ipc
    from scheduler.wire.messages import GenerateReq, SamplingParams
    from scheduler.wire.rank_messages import StepResult

    ipc.send(front, GenerateReq("b", [3, 4, 6], SamplingParams(max_tokens=1)))
    time.sleep(gap_s)
    ipc.send(front, GenerateReq("c", [3, 4, 7], SamplingParams(max_tokens=1)))
    first = None
    assert rank.poll(10.0)
    while rank.poll(1.5):
        plan = ipc.recv(rank)
        if plan.seqs and first is None:
            first = [seq.rid for seq in plan.seqs]
        sampled = [seq for seq in plan.seqs if seq.sample is not None]
        ipc.send(rank, StepResult(plan.step_id, [7] * len(sampled), 0.0, [0.0] * len(sampled)))
    while front.poll(0.1):  # their tokens
        ipc.recv(front)
    return first


@pytest.mark.parametrize("wait_ms", [0.0, 1000.0])
def test_prompts_arriving_together_start_in_one_step(monkeypatch, wait_ms):
    """``batch_wait_ms``: a step with nothing decoding takes the prompts that arrive within the
    wait, on a fresh server and again once those requests finished (both prompts share one
    step); without it the first prompt is planned alone at once."""
    with _scheduler_loop(monkeypatch, batch_wait_ms=wait_ms) as (front, rank, checks):
        assert _first_plan_rids(front, rank, gap_s=0.2) == (["b", "c"] if wait_ms else ["b"])
        assert _first_plan_rids(front, rank, gap_s=0.2) == (["b", "c"] if wait_ms else ["b"])


def test_the_step_log_has_a_line_per_step(monkeypatch, tmp_path):
    """``--step-log``: a line per step sent to rank 0, with the rank's seconds as it reported
    them, each sequence as rid:start+tokens (s: it samples, cN: N cuts) and the step's
    checkpoint loads and stores: the prompt whole, cut at its end minus one, stored after the
    forward; its one decode step; the finished request's store in a step of its own."""
    from scheduler.wire import ipc
    from scheduler.wire.messages import GenerateReq, SamplingParams
    from scheduler.wire.rank_messages import StepResult

    log = tmp_path / "steps.log"
    with _scheduler_loop(monkeypatch, step_log=str(log), batch_wait_ms=0.0) as (front, rank, _):
        ipc.send(front, GenerateReq("a", [3, 4, 5, 6], SamplingParams(max_tokens=2)))
        steps = 0
        assert rank.poll(10.0)
        while rank.poll(1.5):
            plan = ipc.recv(rank)
            sampled = [q for q in plan.seqs if q.sample is not None]
            ipc.send(rank, StepResult(plan.step_id, [7] * len(sampled), 0.25,
                                      [0.0] * len(sampled)))
            steps += 1
        while front.poll(0.1):
            ipc.recv(front)
    lines = [line.split(" ", 4) for line in log.read_text().splitlines()]
    assert len(lines) == steps == 3
    assert all(float(rank_s) == 0.25 and float(wall) >= 0.0 for _, wall, rank_s, _, _ in lines)
    assert [" ".join(line[3:]) for line in lines] == ["step=1 [a:0+4sc1] loads=0 stores=0+1",
                                                      "step=2 [a:4+1s] loads=0 stores=0+0",
                                                      "step=3 [] loads=0 stores=1+0"]
    assert abs(float(lines[0][0]) - time.time()) < 60  # Unix seconds
