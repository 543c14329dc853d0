"""The front end's side of the scheduler connection (``EngineClient``: requests out, token
batches in, one queue per request) and one HTTP generation request as the response builders see
it: its ``Job``, ``Choice``s and text ``Delta``s."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from queue import SimpleQueue

from dasc_server.chat import ReasoningStream, ToolCallStream
from dasc_server.metrics import Metrics
from dasc_server.tokenizer import TextOffsets
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

# The front end's side of the scheduler connection.
#
# One reader thread receives ``TokenBatch`` / ``FlushCacheDone`` / ``Stats`` frames and hands them
# to the event loop; a step's batch is split there into its requests' ``TokenOut``s, and each
# request awaits its own queue.  One writer thread sends the front end's messages, so
# a scheduler that is slow to read never blocks the event loop (and with it every HTTP request).
# A request whose consumer goes away (client disconnect, stop string matched) is aborted at the
# scheduler, which frees it after its in-flight step.

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


# One HTTP generation request as the response builders see it: its ``Job`` and ``Choice``s
# (one engine request per choice: ``n`` samples of each prompt of a batch), a choice's text
# ``Delta``s, and what a JSON answer ``Collected`` of a choice.

@dataclass(slots=True)
class Choice:
    """One sample of one prompt: its own engine request.  ``index`` is OpenAI's,
    prompt-major: ``prompt_index * n + sample_index``."""

    index: int
    prompt_index: int
    sample_index: int
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    offsets: TextOffsets = field(default_factory=TextOffsets)  # completions' text_offset
    tool_calls: ToolCallStream | None = None  # chat with tools: calls parsed from the text
    reasoning: ReasoningStream | None = None  # chat, reasoning template: <think> split out
    echo_only: bool = False  # echo with max_tokens 0: the engine's one token is dropped


@dataclass(slots=True)
class Job:
    """One validated HTTP request: its choices and what they share."""

    is_chat: bool
    id: str
    model: str
    choices: list[Choice]
    stop: list[str]
    return_token_ids: bool
    include_usage: bool
    logprobs: bool  # completions' ``logprobs`` set, or chat's ``logprobs: true``
    created: int
    metrics: Metrics
    arrived: float  # perf_counter() when the request was accepted
    share_prompts: bool = True  # hold samples j > 0 until sample 0 has cached the prompt
    num_returned: int = 1  # choices per prompt in the answer (n); fewer than drawn: best_of
    primed: dict[int, asyncio.Event] = field(default_factory=dict)  # by prompt index
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion

    def envelope(self, chunk: bool) -> dict:
        if self.is_chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        prefix = "chatcmpl-" if self.is_chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created,
                "model": self.model}

    def usage(self) -> dict:
        """As OpenAI counts: each prompt once (with its first sample's cache hit), every
        choice's completion tokens."""
        firsts = [c for c in self.choices if c.sample_index == 0]
        num_prompt = sum(len(c.prompt_ids) for c in firsts)
        num_completion = sum(c.num_completion_tokens for c in self.choices)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # set on the last delta only
    top_ids: list[list[int]] = field(default_factory=list)  # as TokenOut's
    top_logprobs: list[list[float]] = field(default_factory=list)
    # echo, first delta only: the prompt's ids and (with logprobs) TokenOut's prompt_* fields
    echo_ids: list[int] = field(default_factory=list)
    echo_logprobs: list[float] = field(default_factory=list)
    echo_top_ids: list[list[int]] = field(default_factory=list)
    echo_top_logprobs: list[list[float]] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # chat: calls completed here
    reasoning: str = ""  # chat: reasoning_content of this delta


@dataclass(slots=True)
class Collected:
    """A choice's deltas joined, for the JSON answer."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    echo_ids: list[int] = field(default_factory=list)  # as Delta's
    echo_logprobs: list[float] = field(default_factory=list)
    echo_top_ids: list[list[int]] = field(default_factory=list)
    echo_top_logprobs: list[list[float]] = field(default_factory=list)
