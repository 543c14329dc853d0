"""Responses of the generation routes: one request's frames -> text deltas -> SSE or JSON.

One generation request: ``engine.generate`` frames -> ``IncrementalDetokenizer`` -> deltas ->
SSE chunks or one JSON body.  Leaving the frame iterator early (stop string matched, client
gone) aborts the request at the scheduler, so every iterator is closed with ``aclosing``: the
abort goes out at once, not at garbage collection.  Latency and outcome go to ``Metrics``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from dasc_server.detokenizer import IncrementalDetokenizer
from dasc_server.engine_client import EngineClient, EngineDead
from dasc_server.metrics import Metrics
from dasc_server.protocol import RequestError
from scheduler.messages import SamplingParams

DONE_FRAME = "data: [DONE]\n\n"


@dataclass(slots=True)
class Job:
    """One validated request and its running counts."""

    is_chat: bool
    rid: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    return_token_ids: bool
    include_usage: bool
    logprobs: bool
    created: int
    metrics: Metrics
    arrived: float  # perf_counter() when the request was accepted
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0

    def envelope(self, chunk: bool) -> dict:
        if self.is_chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        prefix = "chatcmpl-" if self.is_chat else "cmpl-"
        return {"id": prefix + self.rid, "object": obj, "created": self.created,
                "model": self.model}

    def usage(self) -> dict:
        num_prompt = len(self.prompt_ids)
        return {"prompt_tokens": num_prompt, "completion_tokens": self.num_completion_tokens,
                "total_tokens": num_prompt + self.num_completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # set on the last delta only



def engine_down(reason: str) -> RequestError:
    return RequestError(f"the engine is down: {reason}", status=503, type="server_error",
                        code="engine_dead")


async def _deltas(engine: EngineClient, tokenizer: Any | None, job: Job
                  ) -> AsyncIterator[Delta]:
    """Text deltas of one request; raises RequestError if it is refused or the engine dies."""
    detok = IncrementalDetokenizer(tokenizer, job.stop, job.prompt_ids)
    finish = None
    try:
        async with aclosing(engine.generate(job.rid, job.prompt_ids, job.sampling)) as frames:
            async for out in frames:
                if out.finish_reason == "error":
                    if engine.dead is not None:
                        raise engine_down(engine.dead)
                    raise RequestError(out.error or "the scheduler refused the request")
                if out.token_ids and not job.num_completion_tokens:
                    job.metrics.ttft.observe(time.perf_counter() - job.arrived)
                job.num_completion_tokens += len(out.token_ids)
                job.num_cached_tokens = max(job.num_cached_tokens, out.cached_tokens)
                text = detok.step(out.token_ids)
                if out.finished and not detok.stopped:
                    text += detok.flush()
                finish = None
                if detok.stopped:
                    finish = "stop"  # leaving the loop aborts the rest at the scheduler
                elif out.finished:
                    finish = out.finish_reason or "stop"
                if finish is not None:
                    job.metrics.e2e.observe(time.perf_counter() - job.arrived)
                    job.metrics.finished.labels(finish).inc()
                yield Delta(text, list(out.token_ids), list(out.logprobs), finish)
                if finish is not None:
                    return
    except (EngineDead, OSError) as e:
        finish = "error"
        job.metrics.finished.labels(finish).inc()
        raise engine_down(engine.dead or str(e)) from e
    except RequestError:
        finish = "error"
        job.metrics.finished.labels(finish).inc()
        raise
    finally:
        if finish is None:  # the consumer left before the end: the request was aborted
            job.metrics.aborted.inc()


def _sse_frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _choice(job: Job, body: dict, finish_reason: str | None, token_ids: list[int],
            logprobs: list[float], with_prompt_ids: bool) -> dict:
    """``logprobs`` (completions, ``logprobs: 0``): the generated tokens' log-probabilities
    under the model (temperature 1); tokens are given by id as strings when no tokenizer."""
    report = None
    if job.logprobs:
        report = {"tokens": [str(t) for t in token_ids], "token_logprobs": logprobs,
                  "top_logprobs": None, "text_offset": None}
    choice = {"index": 0, **body, "logprobs": report, "finish_reason": finish_reason}
    if job.return_token_ids:
        choice["token_ids"] = token_ids
        if with_prompt_ids:
            choice["prompt_token_ids"] = job.prompt_ids
    return choice


def _chunk(job: Job, delta: Delta, is_first: bool) -> dict:
    if job.is_chat:
        message: dict[str, str] = {"role": "assistant"} if is_first else {}
        if delta.text or is_first:
            message["content"] = delta.text
        body: dict[str, Any] = {"delta": message}
    else:
        body = {"text": delta.text}
    choice = _choice(job, body, delta.finish_reason, delta.token_ids, delta.logprobs,
                     with_prompt_ids=is_first)
    return {**job.envelope(chunk=True), "choices": [choice]}


async def sse_frames(engine: EngineClient, tokenizer: Any | None, job: Job) -> AsyncIterator[str]:
    is_first = True
    try:
        async with aclosing(_deltas(engine, tokenizer, job)) as deltas:
            async for delta in deltas:
                # Chunks without text would give clients a first "token" that is not one.
                has_ids = job.return_token_ids and delta.token_ids
                if not (delta.text or delta.finish_reason or has_ids):
                    continue
                yield _sse_frame(_chunk(job, delta, is_first))
                is_first = False
    except RequestError as e:
        yield _sse_frame(e.body())
        yield DONE_FRAME
        return
    if job.include_usage:
        yield _sse_frame({**job.envelope(chunk=True), "choices": [], "usage": job.usage()})
    yield DONE_FRAME


async def complete_body(engine: EngineClient, tokenizer: Any | None, job: Job) -> dict:
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason = None
    async with aclosing(_deltas(engine, tokenizer, job)) as deltas:
        async for delta in deltas:
            texts.append(delta.text)
            token_ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            finish_reason = delta.finish_reason
    text = "".join(texts)
    body = {"message": {"role": "assistant", "content": text}} if job.is_chat else {"text": text}
    choice = _choice(job, body, finish_reason, token_ids, logprobs, with_prompt_ids=True)
    return {**job.envelope(chunk=False), "choices": [choice], "usage": job.usage()}


async def finished_before_disconnect(task: asyncio.Future, request: Request) -> bool:
    """Wait for ``task``; if the client disconnects first, cancel it (which aborts its
    request) and return False.  The body is already read, so ``receive`` now only reports
    the disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let the abort go out
    return not task.cancelled()
