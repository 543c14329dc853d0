"""``dasc-serve``: one command starts the scheduler, T ranks (torchrun) and the HTTP front end.

Processes: this one runs the front end (uvicorn, FastAPI); ``python -m scheduler`` owns the
queue, the radix cache and the pools; ``torchrun ... -m model_runner.serve_rank`` runs the T
ranks (one plain process at T = 1).  Connections are loopback TCP with a per-launch secret.
The flags are parsed once, here (``dasc_server.flags``): each child gets the one frozen
``ServeConfig`` they make as a JSON argument, and the scheduler hands it back in ``ServerInfo``.
Start-up failures end the server at once with one ``error:`` line and a non-zero exit: bad
flags, a port that is taken (the HTTP port is bound before any model loads), a missing CUDA
device, a child that dies before the server is ready.  The children's own ``error:`` lines are
held back and folded into that one line; the rest of their stderr passes through.

SIGINT (Ctrl-C) and SIGTERM stop the server quietly with exit 0: in-flight requests finish,
then the scheduler stops the ranks.  The children start with SIGINT and SIGTERM ignored, so a
signal sent to the whole process group (a terminal's Ctrl-C; systemd's default
``KillMode=control-group``, ``docker stop`` on a shell entrypoint, ``kill -TERM -- -PGID``) is
handled by this process alone, and the children keep serving the requests that drain.  A
request still running when ``--shutdown-timeout`` expires ends with an error (a streamed one
with an error frame and ``[DONE]``).  Children that do not stop when told get SIGHUP, then
SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from dasc_server.flags import FrontEndOptions, parse_args, serve_config, validate
from model_runner import cpu_affinity
from model_runner.processes import exit_now
from scheduler.wire import ipc
from scheduler.wire.messages import ServerInfo, Shutdown
from scheduler.wire.serve_config import ServeConfig


def bind_http(host: str, port: int) -> socket.socket:
    """Claim the HTTP port before any model loads; uvicorn listens on it once ready.  The proto
    must say TCP: only then does asyncio turn Nagle's algorithm off on accepted connections
    (with proto 0 a streamed frame after the headers waited for the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class ChildErrors:
    """Relays the children's stderr, holding back their one-line ``error:`` messages: the
    launcher prints a single error line of its own, naming the first of them."""

    def __init__(self):
        self.lines: list[str] = []
        self._threads: list[threading.Thread] = []

    def relay(self, proc: subprocess.Popen) -> subprocess.Popen:
        t = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        t.start()
        self._threads.append(t)
        return proc

    def _pump(self, stream) -> None:
        for line in stream:
            if line.startswith("error: "):
                self.lines.append(line[len("error: "):].rstrip())
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    def explain(self, what: str) -> str:
        """``what`` went wrong, with the first child's own message (once its stream ends)."""
        for t in self._threads:
            t.join(timeout=2.0)
        return f"{what}: {self.lines[0]}" if self.lines else what


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # this process's to handle, never a child's


def _spawn(cmd: list[str], env: dict[str, str], errors: ChildErrors,
           pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start a child with ``STOP_SIGNALS`` ignored (inherited through exec; Python keeps them
    ignored, and ``quiet_torchrun`` leaves them to this process)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1, pass_fds=pass_fds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return errors.relay(proc)


def start_children(args: argparse.Namespace, config: ServeConfig, errors: ChildErrors
                   ) -> dict[str, subprocess.Popen]:
    """The scheduler (node 0 only) and this node's ranks, each handed ``config`` whole.  The
    scheduler's two listening sockets are bound here and passed down, so their ports are taken
    before anyone is told them (only rank 0, on node 0, connects to the scheduler)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the scheduler's
    env[ipc.AUTHKEY_ENV] = ipc.new_authkey()
    os.environ[ipc.AUTHKEY_ENV] = env[ipc.AUTHKEY_ENV]
    if config.ranks.cpu_bind:  # each child binds itself; this process once they are started
        plan = cpu_affinity.node_plan(args.tp // args.nnodes, config.ranks.cpu_threads)
        env.update(plan)
        os.environ.update(plan)
    rank_env = dict(env, OMP_NUM_THREADS=str(config.ranks.cpu_threads))
    py, as_json = sys.executable, config.to_json()
    if args.node_rank > 0:
        ranks = [py, "-m", *torchrun_args(args), "model_runner.serve_rank", "--scheduler-port",
                 "0", "--config", as_json]
        children = {"ranks": _spawn(ranks, rank_env, errors)}
        _bind_front(config)
        return children
    rank_sock, front_sock = ipc.listening_socket(), ipc.listening_socket()
    args.frontend_port = front_sock.getsockname()[1]
    fds = (rank_sock.fileno(), front_sock.fileno())
    sched = [py, "-m", "scheduler", "--rank-fd", str(fds[0]), "--frontend-fd", str(fds[1]),
             "--config", as_json]
    ranks = [py, "-m", *torchrun_args(args), "model_runner.serve_rank", "--scheduler-port",
             str(rank_sock.getsockname()[1]), "--config", as_json]
    with rank_sock, front_sock:  # the scheduler holds its own copies once started
        scheduler = _spawn(sched, env, errors, pass_fds=fds)
    children = {"scheduler": scheduler, "ranks": _spawn(ranks, rank_env, errors)}
    _bind_front(config)
    return children


def _bind_front(config: ServeConfig) -> None:
    """``--cpu-bind on``: this process (the front end) onto the CPUs the ranks left, and say
    where each went."""
    if not config.ranks.cpu_bind:
        return
    rest = cpu_affinity.bind_rest()
    ranks = os.environ[cpu_affinity.RANK_CPUS_ENV].replace(";", " | ")
    where = ",".join(map(str, rest)) if rest else "theirs (none left)"
    print(f"dasc-serve: --cpu-bind on: this node's ranks on CPUs {ranks}; its other processes "
          f"(the scheduler and front end on node 0) on {where}", file=sys.stderr, flush=True)


TORCHRUN = "model_runner.quiet_torchrun"  # torchrun, quiet when the ranks stop or fail


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """``python -m`` arguments that start this node's ranks (plain process at TP=1)."""
    if args.tp == 1:
        return []
    if args.nnodes == 1:
        return [TORCHRUN, "--standalone", f"--nproc-per-node={args.tp}", "-m"]
    return [TORCHRUN, f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
            f"--nproc-per-node={args.tp // args.nnodes}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}", "-m"]


def wait_ready(args: argparse.Namespace, children: dict[str, subprocess.Popen]):
    """Connect to the scheduler and wait for its ServerInfo, failing fast if a child dies."""
    deadline = time.monotonic() + args.startup_timeout
    conn = None
    while conn is None:
        dead = _dead_child(children)
        if dead:
            raise RuntimeError(f"{dead} before the server was ready")
        try:
            conn = ipc.connect(args.frontend_port, timeout=0.5)
        except RuntimeError:  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not start within "
                                   f"{args.startup_timeout:.0f} s") from None
    while not conn.poll(0.2):
        dead = _dead_child(children)
        if dead:
            raise RuntimeError(f"{dead} before the server was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not start within {args.startup_timeout:.0f} s")
    info = ipc.recv(conn)
    if not isinstance(info, ServerInfo):
        raise RuntimeError(f"the scheduler sent {type(info).__name__} instead of ServerInfo")
    return conn, info


def _dead_child(children: dict[str, subprocess.Popen]) -> str | None:
    for name, proc in children.items():
        code = proc.poll()
        if code is not None:
            what = "the rank processes" if name == "ranks" else "the scheduler"
            return f"{what} exited with code {code}"
    return None


def stop_children(children: dict[str, subprocess.Popen], conn) -> None:
    """With a scheduler connection, ask the scheduler to stop the ranks (10 s); without one
    (still starting), at once.  A child still running then gets SIGHUP (they ignore SIGTERM;
    torchrun stops its ranks on SIGHUP), and 5 s later SIGKILL."""
    if conn is not None:
        try:
            ipc.send(conn, Shutdown())
        except OSError:
            pass
    deadline = time.monotonic() + (10 if conn is not None else 0)
    for proc in children.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGHUP)
    for proc in children.values():
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def ready_line(args: argparse.Namespace, info: ServerInfo, name: str) -> str:
    rank, ckpt = info.rank, info.config.checkpoints
    return (f"dasc-serve ready: http://{args.host}:{args.port} model={name} tp={rank.tp_size} "
            f"threads={info.config.ranks.cpu_threads} weight_bytes={rank.weight_bytes} "
            f"checkpoint_slots={rank.num_checkpoint_slots} "
            f"bytes_per_slot={rank.checkpoint_bytes_per_slot} "
            f"(dense {rank.dense_bytes_per_slot}) wmax={ckpt.w_max:g} "
            f"chunked_prefill_size={info.chunked_prefill_size} "
            f"load_policy={ckpt.load_policy} prefix_cache={info.config.scheduling.prefix_cache}")


def preload_tokenizer(args: argparse.Namespace) -> Future:
    """The front end's tokenizer (2-3 s, mostly importing transformers), loaded in a daemon
    thread while the ranks start rather than after them; ``result()`` re-raises its error."""
    future: Future = Future()

    def load() -> None:
        try:
            from model_runner.generate import load_tokenizer

            future.set_result(load_tokenizer(Path(args.model)))
        except Exception as e:  # noqa: BLE001 - raised where the tokenizer is needed
            future.set_exception(e)

    threading.Thread(target=load, name="tokenizer", daemon=True).start()
    return future


EXPIRED_GRACE_S = 5.0  # after --shutdown-timeout: the expired requests' last frames go out


def serve(args: argparse.Namespace, conn, info: ServerInfo,
          children: dict[str, subprocess.Popen], sock: socket.socket,
          tokenizer: Future) -> str | None:
    """Run the front end on ``sock`` until a signal (None) or a failure (its message)."""
    import uvicorn
    import uvloop

    from dasc_server.app import create_app
    from dasc_server.engine_client import EngineClient

    name = args.served_model_name or Path(args.model).name
    failure: list[str] = []
    engine = EngineClient(conn, info, on_lost=lambda why: _fail(failure, why, server))
    options = FrontEndOptions(api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                              max_queued_requests=args.max_queued_requests)
    app = create_app(engine, tokenizer.result(), name, options)
    expired = f"the server is shutting down (--shutdown-timeout {args.shutdown_timeout:g} s)"

    class Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGINT/SIGTERM once it has shut down, which would kill
        this process before it stops the scheduler and the ranks; here a signal is a normal
        stop.  The first one also sets the drain's deadline: then the requests still running
        end with an error (``EngineClient.expire``), a stream with an error frame and
        ``[DONE]``, within uvicorn's own limit (which would cut them mid-stream)."""

        loop: asyncio.AbstractEventLoop | None = None
        deadline_set = False

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            if self.loop is not None and not self.deadline_set:
                self.deadline_set = True
                self.loop.call_soon_threadsafe(self.loop.call_later, args.shutdown_timeout,
                                               engine.expire, expired)

    # httptools and uvloop, not h11 and asyncio's loop: the front end shares the CPUs with the
    # ranks, and these cut its CPU per streamed hit by about a quarter (0.90-1.35 -> 0.79-1.03
    # ms; docs/results/serving.md, the per-request cost of a hit)
    server = Server(uvicorn.Config(
        app, log_level="warning", http="httptools",
        timeout_graceful_shutdown=args.shutdown_timeout + EXPIRED_GRACE_S))

    def watch() -> None:
        while not server.should_exit:
            dead = _dead_child(children)
            if dead:
                _fail(failure, dead, server)
            time.sleep(0.2)

    async def run() -> None:
        server.loop = asyncio.get_running_loop()
        engine.start(server.loop)
        threading.Thread(target=watch, name="child-watch", daemon=True).start()
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(ready_line(args, info, name), flush=True)
        await task

    uvloop.run(run())
    return failure[0] if failure else None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM before the front end runs: unwind through stop_children


def run_worker_node(ranks: subprocess.Popen, errors: ChildErrors) -> int:
    """A node other than 0 only hosts ranks; they end when node 0's scheduler stops them."""
    print(f"dasc-serve worker node: ranks started (pid {ranks.pid})", flush=True)
    try:
        code = ranks.wait()
    except KeyboardInterrupt:
        stop_children({"ranks": ranks}, None)
        return 0
    if code != 0:
        print(f"error: {errors.explain(f'the rank processes exited with code {code}')}",
              file=sys.stderr)
    return code


def _fail(failure: list[str], why: str, server) -> None:
    if not failure:
        failure.append(why)
    server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
        config = serve_config(args)
        sock = bind_http(args.host, args.port) if args.node_rank == 0 else None
        if sock is not None:
            args.port = sock.getsockname()[1]  # --port 0: the one the system chose
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    errors = ChildErrors()
    children = start_children(args, config, errors)
    # Every path below stops and reaps the children first; then the launcher skips the
    # interpreter's teardown (~1 s with torch and transformers loaded).
    if args.node_rank > 0:
        exit_now(run_worker_node(children["ranks"], errors))
    exit_now(run_front_node(args, sock, children, errors))


def run_front_node(args: argparse.Namespace, sock: socket.socket,
                   children: dict[str, subprocess.Popen], errors: ChildErrors) -> int:
    """Node 0: wait for the ranks, serve until a signal or a failure, stop the children."""
    conn = failure = None
    tokenizer = preload_tokenizer(args)
    try:
        conn, info = wait_ready(args, children)
        failure = serve(args, conn, info, children, sock, tokenizer)
    except (RuntimeError, OSError) as e:
        failure = str(e)
    except KeyboardInterrupt:
        pass
    finally:
        stop_children(children, conn)
    if failure:
        print(f"error: {errors.explain(failure)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
