"""Transport between processes: ``multiprocessing.connection`` over loopback TCP.

Why this transport: it is in the standard library (no broker, no extra dependency), it frames
messages, and its ``authkey`` handshake (HMAC challenge) keeps other local users from talking to
the scheduler.  Every connection is point to point (front end <-> scheduler <-> rank 0) and
strictly ordered, which is all the engine needs.  Messages are the dataclasses and enums of
``scheduler.wire.messages.MESSAGE_TYPES`` (the serving config's among them), pickled; decoding goes
through an unpickler that only builds those classes, each from its own module, so a peer can
never make us import or call anything else.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import socket
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from scheduler.wire import messages

AUTHKEY_ENV = "DASC_IPC_AUTHKEY"
_ALLOWED = {(cls.__module__, cls.__name__): cls for cls in messages.MESSAGE_TYPES}


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        cls = _ALLOWED.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"refusing to decode {module}.{name}")
        return cls


def send(conn: Connection, msg: object) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> object:
    return _MessageUnpickler(io.BytesIO(conn.recv_bytes())).load()


def new_authkey() -> str:
    return secrets.token_hex(16)


def authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        raise RuntimeError(f"{AUTHKEY_ENV} is not set: processes must be started by dasc-serve")
    return key.encode()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def no_delay(conn: Connection) -> Connection:
    """Send small frames at once: without TCP_NODELAY, Nagle's algorithm and delayed ACKs held
    a stream's second token back ~40 ms and then released ~10 at once."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:  # the dup shares the socket
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a free port, for the process that binds it to hand to a child
    (``pass_fds``, then ``InheritedListener``).  A port chosen with ``free_port`` is free again
    until its listener binds it, and under load another process took it in that window
    (``OSError: [Errno 98] Address already in use`` at the scheduler's start)."""
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    return sock


class InheritedListener:
    """``Listener`` over a listening socket passed down by file descriptor: ``accept`` runs the
    same HMAC handshake as ``Listener.accept`` (deliver a challenge, then answer one)."""

    def __init__(self, fd: int):
        self._sock = socket.socket(fileno=fd)

    def accept(self) -> Connection:
        sock, _ = self._sock.accept()
        sock.setblocking(True)
        conn, key = Connection(sock.detach()), authkey()
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        return conn

    def close(self) -> None:
        self._sock.close()


def accept(listener: InheritedListener) -> Connection:
    return no_delay(listener.accept())


def connect(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> Connection:
    """Connect, retrying while the peer is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return no_delay(Client((host, port), authkey=authkey()))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reach {host}:{port} within {timeout:.0f} s"
                                   ) from None
            time.sleep(0.05)
