"""The JSON (non-streamed) answer of a generation request: every choice's deltas collected,
the best ``n`` of ``best_of`` kept, chat tool calls split from the content; and the wait that
cancels the request when the client disconnects first."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import Request

from dasc_server.choice_fields import choice_fields
from dasc_server.deltas import all_deltas
from dasc_server.engine_client import EngineClient
from dasc_server.jobs import Choice, Collected, Job
from dasc_server.reasoning import split_reasoning
from dasc_server.tool_calls import split_calls


def _message(choice: Choice, got: Collected) -> dict:
    """A chat choice's message: its reasoning (a reasoning template) and, with tools, its
    calls apart from its content."""
    text, message = "".join(got.texts), {"role": "assistant"}
    if choice.reasoning is not None:
        reasoning, text = split_reasoning(text, choice.reasoning.inside)
        message["reasoning_content"] = reasoning
    if choice.tool_calls is None:
        return {**message, "content": text}
    content, calls = split_calls(text, choice.tool_calls)
    if not calls:
        return {**message, "content": text}
    if got.finish_reason == "stop":
        got.finish_reason = "tool_calls"
    return {**message, "content": content, "tool_calls": calls}


def _best(job: Job, collected: dict[int, Collected]) -> list[tuple[Choice, Collected]]:
    """The choices to return, in index order: all of them, or (``best_of`` > n) the
    ``num_returned`` samples of each prompt with the highest mean token log-probability,
    renumbered ``prompt_index * n + rank`` as OpenAI numbers them."""
    ordered = sorted(job.choices, key=lambda c: c.index)
    if sum(1 for c in ordered if c.prompt_index == 0) <= job.num_returned:
        return [(c, collected[c.index]) for c in ordered]

    def mean_logprob(c: Choice) -> float:
        logprobs = collected[c.index].logprobs
        return sum(logprobs) / len(logprobs) if logprobs else float("-inf")

    best = []
    for prompt_index in dict.fromkeys(c.prompt_index for c in ordered):
        samples = [c for c in ordered if c.prompt_index == prompt_index]
        ranked = sorted(samples, key=mean_logprob, reverse=True)[: job.num_returned]
        best += [(replace(c, index=prompt_index * job.num_returned + rank), collected[c.index])
                 for rank, c in enumerate(ranked)]
    return best


async def complete_body(engine: EngineClient, tokenizer: Any | None, job: Job) -> dict:
    """The JSON body, choices in index order; the first choice to fail raises its error."""
    collected = {c.index: Collected() for c in job.choices}
    async with aclosing(all_deltas(engine, tokenizer, job)) as deltas:
        async for choice, delta in deltas:
            got = collected[choice.index]
            got.texts.append(delta.text)
            got.token_ids.extend(delta.token_ids)
            got.logprobs.extend(delta.logprobs)
            got.top_ids.extend(delta.top_ids)
            got.top_logprobs.extend(delta.top_logprobs)
            if delta.echo_ids:
                got.echo_ids, got.echo_logprobs = delta.echo_ids, delta.echo_logprobs
                got.echo_top_ids, got.echo_top_logprobs = (delta.echo_top_ids,
                                                           delta.echo_top_logprobs)
            got.finish_reason = delta.finish_reason
    choices = []
    for choice, got in _best(job, collected):
        body = ({"message": _message(choice, got)} if job.is_chat
                else {"text": "".join(got.texts)})
        choices.append(choice_fields(job, choice, body, got, tokenizer, with_prompt_ids=True))
    return {**job.envelope(chunk=False), "choices": choices, "usage": job.usage()}


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
