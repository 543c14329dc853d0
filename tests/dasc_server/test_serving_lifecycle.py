"""dasc-serve as one command: SIGTERM and Ctrl-C stop every process it started, quietly, after
draining the requests in flight (to ``--shutdown-timeout``), whether the signal reaches the
launcher alone or its whole process group; a child that dies ends the server with a non-zero
exit and one error line naming it; bad arguments and taken ports fail before any model
loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.process_helpers import children_of, children_running, wait_group_gone
from support.serving import KIMI, QWEN, running_server

from dasc_server import launch
from loadgen.spawn import descendants


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dasc-serve still running after {timeout} s")


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"processes {alive} outlived dasc-serve")


def assert_quiet(log: str) -> None:
    assert "Traceback" not in log and "Exception" not in log and "error" not in log, log


def run_launcher(*flags: str, timeout: float = 90.0) -> tuple[int, str, float]:
    """Run dasc-serve to its end in a session of its own: (exit code, output, seconds); it
    fails the test if dasc-serve hangs or leaves a process behind."""
    cmd = [sys.executable, "-m", "dasc_server.launch", "--model", str(KIMI), *flags]
    if "--port" not in flags:
        cmd += ["--port", "0"]  # a free port, bound by the launcher itself
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"dasc-serve {' '.join(flags)} still running after {timeout} s")
    wait_group_gone(proc.pid)
    return proc.returncode, out, time.monotonic() - started


def the_error(out: str) -> str:
    """The one ``error:`` line of a failed start, with no traceback around it."""
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    return errors[0]


def test_sigterm_stops_every_process_and_exits_zero():
    with running_server("--model", str(KIMI), "--tp", "2") as server:
        assert server.complete([65, 66, 67], max_tokens=2)["choices"][0]["token_ids"]
        assert len(children_of(server.proc.pid)) == 2  # scheduler + torchrun
        below = descendants(server.proc.pid)
        assert len(below) == 4  # + the two ranks
        server.proc.send_signal(signal.SIGTERM)  # the launcher only, not its group
        assert wait_exit(server.proc, 20) == 0
        wait_group_gone(server.proc.pid)
        wait_gone(below)
        assert_quiet(server.log().split("\n", 1)[1])  # all but the ready line


@pytest.mark.parametrize("tp, sig", [(1, signal.SIGINT), (2, signal.SIGINT),
                                     (1, signal.SIGTERM)])
def test_ctrl_c_and_sigterm_stop_quietly(tp, sig):
    """A terminal's Ctrl-C reaches the whole process group; SIGTERM (as from ``kill``) the
    launcher only.  Either way: exit 0, no traceback, no process left."""
    with running_server("--model", str(KIMI), "--tp", str(tp)) as server:
        assert server.complete([65, 66, 67], max_tokens=2)["choices"][0]["token_ids"]
        below = descendants(server.proc.pid)
        if sig == signal.SIGINT:
            os.killpg(server.proc.pid, sig)
        else:
            server.proc.send_signal(sig)
        assert wait_exit(server.proc, 30) == 0
        wait_gone(below)
        assert_quiet(server.log().split("\n", 1)[1])


def test_ctrl_c_while_the_model_loads_stops_quietly():
    cmd = [sys.executable, "-m", "dasc_server.launch", "--model", str(KIMI), "--tp", "2",
           "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 60
        while len(descendants(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # until both ranks exist (they are still importing or loading)
        below = descendants(proc.pid)
        assert len(below) == 4
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0
    assert_quiet(out)
    wait_gone(below)


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
    """A rank that fails before it connects (here: a budget that holds no checkpoint slot) ends
    dasc-serve with one error line naming the cause, not a wait.  The ranks' other
    lines pass through: in bf16 on a CPU that emulates it, rank 0's note says so."""
    from model_runner.cpu_features import cpu_has_native_bf16

    code, out, seconds = run_launcher("--tp", str(tp), "--state-budget-bytes", "100",
                                      "--dtype", "bfloat16")
    assert code == 1 and seconds < 60
    error = the_error(out)
    assert "the rank processes exited" in error and "holds no checkpoint slot" in error
    assert out.count("note: bfloat16 is emulated") == (0 if cpu_has_native_bf16() else 1)


def test_a_scheduler_failing_at_start_up_ends_the_server():
    cmd = [sys.executable, "-m", "dasc_server.launch", "--model", str(KIMI), "--port",
           "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 30
        while not children_running(proc.pid, "-m\0scheduler") and time.monotonic() < deadline:
            time.sleep(0.02)
        below = descendants(proc.pid)
        os.kill(children_running(proc.pid, "-m\0scheduler")[0], signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1 and time.monotonic() - killed < 10
    assert the_error(out) == "error: the scheduler exited with code -9 before the server was " \
                             "ready"
    wait_gone(below)


def test_a_busy_or_invalid_port_fails_before_any_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, seconds = run_launcher("--port", str(port))
    assert code == 2 and seconds < 15  # no child started: the port is bound first
    assert the_error(out) == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_a_missing_cuda_device_fails_before_anything_starts(capfd):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    code, err = launch_in_process(capfd, "--model", str(KIMI), "--device", "cuda")
    assert code == 2
    assert err.strip() == "error: --device cuda needs 1 CUDA device(s) on this node, 0 visible"


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


def launch_in_process(capfd, *flags: str) -> tuple[int, str]:
    """dasc-serve's ``main`` in this process, for flags it must refuse before it starts
    anything: (exit code, stderr); it fails the test if a child process was started."""
    before = set(descendants(os.getpid()))
    capfd.readouterr()
    code = launch.main(list(flags))
    assert set(descendants(os.getpid())) <= before, "a child started for refused flags"
    return code, capfd.readouterr().err


def test_bad_arguments_fail_before_anything_starts(tmp_path, capfd):
    code, err = launch_in_process(capfd, "--model", str(tmp_path), "--port", "0")
    assert code == 2 and err.startswith("error: ") and "config.json" in err
    code, err = launch_in_process(capfd, "--model", str(KIMI), "--tp", "3")
    # the field as this config file holds it (Kimi-Linear nests its linear-attention fields)
    assert code == 2 and "field 'linear_attn_config.num_heads'=4 is not divisible by tp=3" in err
    for flags, message in ((["--tp", "0"], "--tp must be at least 1 (got 0)"),
                           (["--wmax", "-5"], "--wmax must be >= 0 (got -5.0)"),
                           (["--port", "70000"], "--port must lie in [0, 65535] (got 70000)")):
        code, err = launch_in_process(capfd, "--model", str(KIMI), *flags)
        assert code == 2 and err.strip() == f"error: {message}"


def test_step_target_derives_the_prefill_budget_from_the_ranks_measurement():
    """--step-target-ms reaches the ranks, which time a prefill; the scheduler's budget is then
    above the 64-token floor that a missing measurement (rate 0) would give."""
    import httpx

    with running_server("--model", str(KIMI), "--step-target-ms", "2000") as server:
        info = httpx.get(server.base_url + "/server_info", timeout=30).json()
        assert info["chunked_prefill_size"] % 64 == 0 and info["chunked_prefill_size"] > 64
        assert server.complete([65, 66, 67], max_tokens=2)["choices"][0]["token_ids"]


def _stream(server, max_tokens: int, lines: list[str], first: threading.Event) -> None:
    """A greedy streamed completion that ignores EOS; its SSE data lines go into ``lines``."""
    body = {"prompt": [65, 66, 67], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                first.set()
    first.set()


def _stream_then_signal(server, max_tokens: int) -> tuple[list[str], int]:
    """Start a stream, SIGTERM the launcher's whole process group once its first frame is in
    (as systemd, ``docker stop`` on a shell entrypoint or ``kill -TERM -- -PGID`` do), and
    return (its data lines, how many had arrived when the signal went)."""
    lines: list[str] = []
    first = threading.Event()
    reader = threading.Thread(target=_stream, args=(server, max_tokens, lines, first))
    reader.start()
    assert first.wait(60)
    at_signal = len(lines)
    os.killpg(server.proc.pid, signal.SIGTERM)
    reader.join(60)
    assert not reader.is_alive()
    return lines, at_signal


def test_sigterm_to_the_whole_group_drains_the_streams_in_flight():
    """Every process gets the SIGTERM: the children ignore it, the launcher drains the stream
    to its end (every token, the usage chunk, ``[DONE]``), then stops them and exits 0."""
    with running_server("--model", str(QWEN), "--tp", "2") as server:
        below = descendants(server.proc.pid)
        lines, at_signal = _stream_then_signal(server, max_tokens=400)
        assert wait_exit(server.proc, 60) == 0
        wait_gone(below)
        assert_quiet(server.log().split("\n", 1)[1])
    assert at_signal < len(lines) - 2  # frames kept coming after the signal
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 400


def test_a_stream_past_the_shutdown_timeout_ends_with_an_error_frame():
    """A stream still running when ``--shutdown-timeout`` expires gets an error frame and
    ``[DONE]`` (not a cut connection), and the server exits 0 without a traceback."""
    with running_server("--model", str(QWEN), "--shutdown-timeout", "1") as server:
        below = descendants(server.proc.pid)
        started = time.monotonic()
        lines, _ = _stream_then_signal(server, max_tokens=4000)
        assert time.monotonic() - started < 30
        assert wait_exit(server.proc, 30) == 0
        wait_gone(below)
        assert_quiet(server.log().split("\n", 1)[1])
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert "shutting down" in last["error"]["message"]
