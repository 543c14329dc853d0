"""A server under what users and networks do to it: an API key, oversized bodies, 64 concurrent
streams on 4 active slots, clients vanishing mid-stream, overload, SIGTERM with work in flight,
and a rank killed during a stream.  All against real dasc-serve processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.process_helpers import children_of, children_running, wait_group_gone
from support.serving import KIMI, running_server
from support.serving_reference import Reference

KEY = "test-key-5b1e"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded():
    flags = ["--api-key", KEY, "--max-running-requests", "4", "--checkpoint-slots", "8",
             "--max-request-bytes", "50000", "--checkpoint-interval", "32"]
    with running_server("--model", str(KIMI), *flags) as server:
        yield server, Reference(KIMI)


def stream(base_url: str, prompt: list[int], max_tokens: int, stop_after: int | None = None,
           headers=AUTH) -> tuple[list[int], list[dict]]:
    """Token ids and parsed frames of one streaming request; ``stop_after`` frames then close."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    tokens, frames = [], []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frames.append(json.loads(line[6:]))
                for choice in frames[-1].get("choices", []):
                    tokens += choice.get("token_ids", [])
                if stop_after is not None and len(frames) >= stop_after:
                    break
    return tokens, frames


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def assert_books_balance(server) -> None:
    s = httpx.get(f"{server.base_url}/v1/stats", headers=AUTH, timeout=30).json()
    assert s["integrity"] == "ok" and s["num_running"] == s["num_waiting"] == 0
    assert s["kv_rows_free"] + s["kv_rows_cached"] == s["kv_rows_total"]
    assert s["checkpoint_slots_free"] + s["checkpoint_slots_cached"] == \
        s["checkpoint_slots_total"]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    stems = [list(f"Record {i}: value {rng.randrange(10**6)}. ".encode()) for i in range(5)]
    return [rng.choice(stems) * rng.randrange(1, 4) + list(f"Q{rng.randrange(999)}?".encode())
            for _ in range(n)]


def test_api_key_is_required_everywhere_but_health(guarded):
    server, _ = guarded
    url = server.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", headers=headers,
                          json={"prompt": [65], "max_tokens": 1}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert KEY not in server.log()


def test_oversized_bodies_get_413_and_the_server_keeps_serving(guarded):
    server, ref = guarded
    big = {"prompt": [65] * 20000, "max_tokens": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = (part for part in [json.dumps(big).encode()])  # no Content-Length
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, content=chunked)
    assert r.status_code == 413
    prompt = list(b"Still here?")
    assert stream(server.base_url, prompt, 4)[0] == ref.engine.generate([prompt], 4)[0]


def test_64_concurrent_streams_on_4_slots_are_exact(guarded):
    server, ref = guarded
    jobs = prompts(11, 64)
    expected = [ref.engine.generate([p], 5)[0] for p in jobs]
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda p: stream(server.base_url, p, 5)[0], jobs))
    assert got == expected
    assert_books_balance(server)


def test_clients_that_vanish_mid_stream_leak_nothing(guarded):
    server, ref = guarded
    rng = random.Random(3)
    aborted_before = metric(server, "dasc_aborted_requests_total")
    jobs = [(p, rng.randrange(1, 12)) for p in prompts(5, 20)]
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda j: stream(server.base_url, j[0], 200, stop_after=j[1]), jobs))
    deadline = time.monotonic() + 1.0  # the bound on clean-up after the last disconnect
    # The scheduler frees a request when its abort arrives; the front end counts the abort when
    # the stream's generator is closed, which may come a moment later: wait for both.
    while time.monotonic() < deadline and (
            metric(server, "dasc_running_requests")
            or metric(server, "dasc_aborted_requests_total") - aborted_before < 20):
        time.sleep(0.05)
    assert metric(server, "dasc_running_requests") == 0
    assert metric(server, "dasc_queued_requests") == 0
    assert metric(server, "dasc_aborted_requests_total") - aborted_before == 20
    assert_books_balance(server)
    prompt = jobs[0][0]
    assert stream(server.base_url, prompt, 6)[0] == ref.engine.generate([prompt], 6)[0]


def test_overload_answers_503_with_retry_after():
    """One request runs, one waits, so a third finds the server full.  The slots are held by
    streams kept open on purpose, not by a race between threads, so the test cannot pass or
    fail by timing."""
    flags = ["--max-running-requests", "1", "--max-queued-requests", "1"]
    with running_server("--model", str(KIMI), *flags) as server:
        hold = threading.Event()
        started = threading.Semaphore(0)
        statuses = []

        def held_stream():
            body = {"prompt": [65] * 50, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              timeout=120) as r:
                statuses.append(r.status_code)
                started.release()
                for _ in r.iter_lines():
                    if hold.is_set():
                        return

        readers = [threading.Thread(target=held_stream) for _ in range(2)]
        try:
            for reader in readers:
                reader.start()
                assert started.acquire(timeout=60) and statuses[-1] == 200
                deadline = time.monotonic() + 30
                while (metric(server, "dasc_running_requests")
                       + metric(server, "dasc_queued_requests") < readers.index(reader) + 1):
                    assert time.monotonic() < deadline, "the held request never arrived"
                    time.sleep(0.02)
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                           json={"prompt": [66], "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        finally:
            hold.set()
            for reader in readers:
                if reader.ident is not None:
                    reader.join(60)
        assert server.complete([66, 67], max_tokens=2)["choices"][0]["token_ids"]


def test_sigterm_lets_a_stream_in_flight_finish():
    with running_server("--model", str(KIMI), "--shutdown-timeout", "20") as server:
        result = {}

        def consume():
            result["tokens"], result["frames"] = stream(server.base_url, [65, 66], 300,
                                                        headers={})
        reader = threading.Thread(target=consume)
        reader.start()
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert server.proc.wait(30) == 0
    assert len(result["tokens"]) == 300


def test_rank_killed_mid_stream_ends_the_stream_and_the_server():
    with running_server("--model", str(KIMI), "--tp", "2") as server:
        torchrun = children_running(server.proc.pid, "quiet_torchrun")[0]
        victim = children_of(torchrun)[-1]
        body = {"prompt": [65, 66, 67], "max_tokens": 400, "stream": True, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    os.kill(victim, signal.SIGKILL)
                    killed = time.monotonic()
        assert any('"error"' in line for line in lines), lines[-3:]
        assert server.proc.wait(10) != 0 and time.monotonic() - killed < 10
        wait_group_gone(server.proc.pid)
        assert "error:" in server.log()


def test_two_nodes_serve_the_same_tokens_as_one(tmp_path):
    """Two dasc-serve invocations (node 0: front end, scheduler, rank 0; node 1: rank 1) on
    this machine, TP=2 over torch.distributed's own launcher."""
    import subprocess
    import sys

    from scheduler.wire.ipc import free_port

    port = str(free_port())
    multi = ["--model", str(KIMI), "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", port]
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "dasc_server.launch", *multi,
                              "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        ref = Reference(KIMI)
        with running_server(*multi, "--node-rank", "0") as server:
            assert "tp=2" in server.log()
            for prompt in prompts(2, 4):
                got = server.complete(prompt, max_tokens=5, ignore_eos=True)
                assert got["choices"][0]["token_ids"] == ref.engine.generate([prompt], 5)[0]
        assert node1.wait(30) == 0  # node 0's shutdown stops node 1's rank too
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
        log.close()
