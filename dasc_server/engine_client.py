"""The front end's side of the scheduler connection.

One reader thread receives ``TokenBatch`` / ``FlushCacheDone`` / ``Stats`` frames and hands them
to the event loop; a step's batch is split there into its requests' ``TokenOut``s, and each
request awaits its own queue.  One writer thread sends the front end's messages, so
a scheduler that is slow to read never blocks the event loop (and with it every HTTP request).
A request whose consumer goes away (client disconnect, stop string matched) is aborted at the
scheduler, which frees it after its in-flight step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from queue import SimpleQueue

from scheduler.wire import ipc
from scheduler.wire.messages import (
    AbortReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    SamplingParams,
    ServerInfo,
    Stats,
    StatsReq,
    TokenBatch,
    TokenOut,
)


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, conn: Connection, info: ServerInfo,
                 on_lost: Callable[[str], None] | None = None):
        self.conn, self.info, self.on_lost = conn, info, on_lost
        self._outbox: SimpleQueue = SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiters: dict[type, list[asyncio.Future]] = {FlushCacheDone: [], Stats: []}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        threading.Thread(target=self._read_loop, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="engine-writer", daemon=True).start()

    @property
    def num_active(self) -> int:
        """Requests sent to the scheduler and not finished yet."""
        return len(self._queues)

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(self, rid: str, prompt_ids: list[int], sampling: SamplingParams
                       ) -> AsyncIterator[TokenOut]:
        """Frames of one request until the finished one.  Leaving the iterator early (the
        consumer stopped or was cancelled) aborts the request at the scheduler."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            self._send(GenerateReq(rid, list(prompt_ids), sampling))
            while True:
                out = await queue.get()
                if isinstance(out, EngineDead):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished and self.dead is None:
                self._send(AbortReq(rid))

    async def flush_cache(self) -> FlushCacheDone:
        return await self._ask(FlushCacheReq(), FlushCacheDone)

    async def stats(self) -> Stats:
        return await self._ask(StatsReq(), Stats)

    async def _ask(self, msg: object, reply: type):
        """Replies of one kind come back in the order of the requests."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply].append(fut)
        self._send(msg)
        return await fut

    def _send(self, msg: object) -> None:
        """Queue ``msg`` for the writer thread, in order; never blocks the event loop."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._outbox.put(msg)

    def _write_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            try:
                ipc.send(self.conn, msg)
            except OSError as e:
                self._post(self._fail_all, f"lost the scheduler connection ({type(e).__name__})")
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = ipc.recv(self.conn)
            except (EOFError, OSError) as e:
                self._post(self._fail_all, f"lost the scheduler connection ({type(e).__name__})")
                return
            if not self._post(self._dispatch, msg):
                return

    def _post(self, fn: Callable, *args) -> bool:
        """Run ``fn(*args)`` on the event loop; False once the loop has closed (the server is
        stopping: what the scheduler still sends has nobody left to read it)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, TokenBatch):
            for out in msg.outs:
                queue = self._queues.get(out.rid)
                if queue is not None:  # None: the request left (and was aborted)
                    queue.put_nowait(out)
        elif self._waiters.get(type(msg)):
            fut = self._waiters[type(msg)].pop(0)
            if not fut.done():
                fut.set_result(msg)

    def expire(self, reason: str) -> None:
        """End every request in flight with ``reason`` (the drain's deadline passed): streams
        get an error frame and ``[DONE]``, the rest an error response; nothing new is taken."""
        self._fail_all(reason, lost=False)

    def _fail_all(self, reason: str, lost: bool = True) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDead(reason))
        for fut in (f for waiting in self._waiters.values() for f in waiting):
            if not fut.done():
                fut.set_exception(EngineDead(reason))
        if lost and self.on_lost is not None:
            self.on_lost(reason)
