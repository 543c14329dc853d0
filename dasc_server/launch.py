"""``dasc-serve``: one command starts the scheduler, T ranks (torchrun) and the HTTP front end.

Processes: this one runs the front end (uvicorn, FastAPI); ``python -m scheduler`` owns the
queue, the radix cache and the pools; ``torchrun ... -m model_runner.serve_rank`` runs the T
ranks (one plain process at T = 1).  Connections are loopback TCP with a per-launch secret.
Start-up failures end the server at once with one ``error:`` line and a non-zero exit: bad
flags, a port that is taken (the HTTP port is bound before any model loads), a missing CUDA
device, a child that dies before the server is ready.  The children's own ``error:`` lines are
held back and folded into that one line; the rest of their stderr passes through.

SIGINT (Ctrl-C) and SIGTERM stop the server quietly with exit 0: in-flight requests finish,
then the scheduler stops the ranks.  The children start with SIGINT ignored, so a Ctrl-C in
the terminal, which reaches the whole process group, is handled by this process alone.
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
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.config import DEFAULT_MODEL
from model_runner.rank_args import add_rank_args
from scheduler import ipc
from scheduler.__main__ import add_scheduler_args
from scheduler.messages import ServerInfo, Shutdown

RANK_FLAGS = ("--dtype", "--device", "--cpu-fp32-weights", "--cpu-packed-weights",
              "--step-target-ms", "--wmax", "--load-policy", "--placement",
              "--mask-seed", "--selection", "--state-budget-bytes", "--checkpoint-slots",
              "--cuda-graph-max-bs", "--cuda-graph-max-context")
RANK_SWITCHES = ("--int8-checkpoints", "--disable-cuda-graph")
SCHED_FLAGS = ("--max-total-tokens", "--max-running-requests", "--chunked-prefill-size",
               "--step-target-ms", "--checkpoint-interval", "--wmax", "--load-policy",
               "--schedule-policy", "--schedule-max-passes", "--prefill-mix-ratio",
               "--decode-interleave", "--checkpoint-eviction")
SCHED_SWITCHES = ("--no-prefix-cache", "--no-cache-finished")


def build_parser() -> argparse.ArgumentParser:
    """dasc-serve's flags; declaring them imports no torch, so ``--help`` is instant."""
    p = argparse.ArgumentParser(
        prog="dasc-serve", formatter_class=DefaultsHelpFormatter,
        description="Serve a Qwen3-Next or Kimi-Linear checkpoint with an OpenAI-compatible API "
                    "and a prefix cache of compressed (dasc) recurrent-state checkpoints.")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="folder with config.json and *.safetensors (default: the built-in tiny "
                        "Kimi-Linear model, %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the folder name)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for the ranks to load the model")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DASC_API_KEY if set, else no key)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting beyond --max-running-requests; more get 503")
    g = p.add_argument_group("multi-node (passed to torchrun; node 0 runs the front end and "
                             "the scheduler, other nodes only their ranks)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address for torchrun")
    g.add_argument("--master-port", type=int, default=29500, help="node 0's torchrun port")
    add_rank_args(p)
    add_scheduler_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.api_key is None:  # read here, so that --help never prints the key
        args.api_key = os.environ.get("DASC_API_KEY")
    return args


def validate(args: argparse.Namespace) -> None:
    """What can be checked before any process starts; raises with a one-line message."""
    from model_runner.config import ModelConfig
    from model_runner.loader import check_tp, check_weight_files

    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1 (got {args.tp})")
    model_dir = Path(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    check_tp(cfg, args.tp, str(model_dir / "config.json"))
    check_weight_files(model_dir)
    for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size",
                 "cuda_graph_max_bs", "cuda_graph_max_context", "step_target_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("checkpoint_interval", "wmax", "schedule_max_passes", "prefill_mix_ratio"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    for flag, port in (("--port", args.port), ("--master-port", args.master_port)):
        if not 1 <= port <= 65535:
            raise ValueError(f"{flag} must lie in [1, 65535] (got {port})")
    check_device(args)
    if args.checkpoint_slots is not None and args.checkpoint_slots < 1:
        raise ValueError("--checkpoint-slots must be at least 1")
    if args.tp % args.nnodes or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--tp {args.tp} must split evenly over --nnodes {args.nnodes}, and "
                         f"--node-rank must lie in [0, {args.nnodes})")


def check_device(args: argparse.Namespace) -> None:
    if args.device == "cpu":
        return
    if args.device != "cuda":
        raise ValueError(f"--device must be cpu or cuda (got {args.device!r})")
    import torch

    need, have = args.tp // args.nnodes, torch.cuda.device_count()
    if have < need:
        raise ValueError(f"--device cuda needs {need} CUDA device(s) on this node, "
                         f"{have} visible")


def bind_http(host: str, port: int) -> socket.socket:
    """Claim the HTTP port before any model loads; uvicorn listens on it once ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def _spawn(cmd: list[str], env: dict[str, str], errors: ChildErrors) -> subprocess.Popen:
    """Start a child with SIGINT ignored (inherited through exec; Python keeps it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1)
    finally:
        signal.signal(signal.SIGINT, previous)
    return errors.relay(proc)


def _pass(args: argparse.Namespace, flags: tuple[str, ...], switches: tuple[str, ...]
          ) -> list[str]:
    out = []
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out + [s for s in switches if getattr(args, s[2:].replace("-", "_"))]


def start_children(args: argparse.Namespace, errors: ChildErrors
                   ) -> dict[str, subprocess.Popen]:
    rank_port, front_port = ipc.free_port(), ipc.free_port()
    args.frontend_port = front_port
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[ipc.AUTHKEY_ENV] = ipc.new_authkey()
    os.environ[ipc.AUTHKEY_ENV] = env[ipc.AUTHKEY_ENV]
    py = sys.executable
    sched = [py, "-m", "scheduler", "--rank-port", str(rank_port), "--frontend-port",
             str(front_port), "--model", args.model,
             *_pass(args, SCHED_FLAGS, SCHED_SWITCHES)]
    rank_args = ["--model", args.model, "--scheduler-port", str(rank_port),
                 "--max-total-tokens", str(args.max_total_tokens),
                 "--max-running-requests", str(args.max_running_requests),
                 *_pass(args, RANK_FLAGS, RANK_SWITCHES)]
    ranks = [py, "-m", *torchrun_args(args), "model_runner.serve_rank", *rank_args]
    if args.node_rank > 0:
        return {"ranks": _spawn(ranks, env, errors)}
    return {"scheduler": _spawn(sched, env, errors), "ranks": _spawn(ranks, env, errors)}


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
    (still starting), terminate at once."""
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
            proc.terminate()
    for proc in children.values():
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def ready_line(args: argparse.Namespace, info: ServerInfo, name: str) -> str:
    return (f"dasc-serve ready: http://{args.host}:{args.port} model={name} tp={info.tp_size} "
            f"checkpoint_slots={info.num_checkpoint_slots} "
            f"bytes_per_slot={info.checkpoint_bytes_per_slot} "
            f"(dense {info.dense_bytes_per_slot}) wmax={info.w_max:g} "
            f"chunked_prefill_size={info.chunked_prefill_size} "
            f"load_policy={info.load_policy} prefix_cache={info.prefix_cache}")


def serve(args: argparse.Namespace, conn, info: ServerInfo,
          children: dict[str, subprocess.Popen], sock: socket.socket) -> str | None:
    """Run the front end on ``sock`` until a signal (None) or a failure (its message)."""
    import uvicorn

    from dasc_server.app import FrontEndOptions, create_app
    from dasc_server.engine_client import EngineClient
    from model_runner.generate import load_tokenizer

    name = args.served_model_name or Path(args.model).name
    failure: list[str] = []
    engine = EngineClient(conn, info, on_lost=lambda why: _fail(failure, why, server))
    options = FrontEndOptions(args.api_key, args.max_request_bytes, args.max_queued_requests)
    app = create_app(engine, load_tokenizer(Path(args.model)), name, options)
    class Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGINT/SIGTERM once it has shut down, which would kill
        this process before it stops the scheduler and the ranks; here a signal is a normal
        stop."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    server = Server(uvicorn.Config(app, log_level="warning",
                                   timeout_graceful_shutdown=args.shutdown_timeout))

    def watch() -> None:
        while not server.should_exit:
            dead = _dead_child(children)
            if dead:
                _fail(failure, dead, server)
            time.sleep(0.2)

    async def run() -> None:
        engine.start(asyncio.get_running_loop())
        threading.Thread(target=watch, name="child-watch", daemon=True).start()
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(ready_line(args, info, name), flush=True)
        await task

    asyncio.run(run())
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
        sock = bind_http(args.host, args.port) if args.node_rank == 0 else None
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    errors = ChildErrors()
    children = start_children(args, errors)
    if args.node_rank > 0:
        return run_worker_node(children["ranks"], errors)
    conn = failure = None
    try:
        conn, info = wait_ready(args, children)
        failure = serve(args, conn, info, children, sock)
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
