"""Real dasc-serve processes for tests (``loadgen.spawn``), the built-in model paths and
their byte tokenizer (id == UTF-8 byte, ``EOS`` = 258 = <eos>)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from loadgen.spawn import ROOT, Server, running_server
from scheduler.wire import ipc

ASSETS = ROOT / "model_runner" / "assets"
KIMI, QWEN = ASSETS / "kimi-linear-tiny", ASSETS / "qwen3-next-tiny"
EOS = 258

__all__ = ["EOS", "KIMI", "QWEN", "Server", "ids", "ipc_pair", "running_server"]


def ids(text: str) -> list[int]:
    return list(text.encode())  # the built-in models' byte tokenizer


def ipc_pair(monkeypatch) -> tuple[Connection, Connection]:
    """Two ends of one real authenticated IPC connection, made as the scheduler makes its
    connections: (client, server)."""
    monkeypatch.setenv(ipc.AUTHKEY_ENV, ipc.new_authkey())
    sock = ipc.listening_socket()  # as the launcher binds the scheduler's, adopted by fd
    port, listener = sock.getsockname()[1], ipc.InheritedListener(sock.detach())
    accepted: list = []
    acceptor = threading.Thread(target=lambda: accepted.append(ipc.accept(listener)))
    acceptor.start()
    conn = ipc.connect(port)
    acceptor.join(10)
    listener.close()
    return conn, accepted[0]
