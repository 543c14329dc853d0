"""The streamed (SSE) answer of a generation request: one chunk per choice's delta as they come,
the usage chunk when asked, ``[DONE]``; chat streams split reasoning (``reasoning_content``)
and tool calls out of the text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from dasc_server.choice_fields import choice_fields
from dasc_server.deltas import all_deltas
from dasc_server.engine_client import EngineClient
from dasc_server.jobs import Choice, Delta, Job
from dasc_server.reasoning import ReasoningStream
from dasc_server.request_errors import RequestError
from dasc_server.tool_calls import ToolCallStream

DONE_FRAME = "data: [DONE]\n\n"


def _sse_frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chunk(job: Job, choice: Choice, delta: Delta, tokenizer: Any | None, is_first: bool
           ) -> dict:
    if job.is_chat:
        message: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        if delta.text or (is_first and not delta.reasoning):
            message["content"] = delta.text
        if delta.tool_calls:
            message["tool_calls"] = delta.tool_calls
        body: dict[str, Any] = {"delta": message}
    else:
        body = {"text": delta.text}
    out = choice_fields(job, choice, body, delta, tokenizer, with_prompt_ids=is_first)
    return {**job.envelope(chunk=True), "choices": [out]}


async def sse_frames(engine: EngineClient, tokenizer: Any | None, job: Job) -> AsyncIterator[str]:
    """One chunk per choice's delta, as they come; an error ends the stream with an error
    frame and ``[DONE]`` (the other choices aborted).  Once every choice has finished, what is
    left (the last chunk, the usage chunk, ``[DONE]``) goes out as one write: the socket sends
    each write at once (no Nagle), and a short answer then costs one segment, not three."""
    started: set[int] = set()  # choices that sent their first chunk
    num_finished, tail = 0, ""
    try:
        async with aclosing(all_deltas(engine, tokenizer, job)) as deltas:
            async for choice, delta in deltas:
                if choice.reasoning is not None:
                    _split_reasoning(choice.reasoning, delta)
                if choice.tool_calls is not None:
                    _split_tool_calls(choice.tool_calls, delta)
                # Chunks without text would give clients a first "token" that is not one,
                # unless they carry the token (its id, its logprobs).
                has_ids = (job.return_token_ids or job.logprobs) and delta.token_ids
                if not (delta.text or delta.finish_reason or has_ids or delta.tool_calls
                        or delta.reasoning):
                    continue
                frame = _sse_frame(_chunk(job, choice, delta, tokenizer,
                                          choice.index not in started))
                started.add(choice.index)
                num_finished += delta.finish_reason is not None
                if num_finished < len(job.choices):
                    yield tail + frame
                    tail = ""
                else:
                    tail += frame
    except RequestError as e:
        yield tail + _sse_frame(e.body()) + DONE_FRAME
        return
    if job.include_usage:
        tail += _sse_frame({**job.envelope(chunk=True), "choices": [], "usage": job.usage()})
    yield tail + DONE_FRAME


def _split_reasoning(stream: ReasoningStream, delta: Delta) -> None:
    """A streamed delta's text -> its reasoning and its content (held tag prefixes at the
    end)."""
    delta.reasoning, delta.text = stream.feed(delta.text)
    if delta.finish_reason is not None:
        reasoning, content = stream.finish()
        delta.reasoning += reasoning
        delta.text += content


def _split_tool_calls(stream: ToolCallStream, delta: Delta) -> None:
    """A streamed delta's text -> content and the calls it completes; held text that may
    begin a call is sent when it cannot, or at the end."""
    delta.text, delta.tool_calls = stream.feed(delta.text)
    if delta.finish_reason is not None:
        delta.text += stream.finish()
        if stream.calls and delta.finish_reason == "stop":
            delta.finish_reason = "tool_calls"
