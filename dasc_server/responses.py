"""The answers: a job's engine outputs turned into text deltas, then into SSE frames
(streamed) or one JSON body, with the fields every choice carries (index, finish reason,
logprobs, token ids)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import Request

from dasc_server.chat import ReasoningStream, ToolCallStream, split_calls, split_reasoning
from dasc_server.engine_client import Choice, Collected, Delta, EngineClient, EngineDead, Job
from dasc_server.requests import RequestError
from dasc_server.tokenizer import IncrementalDetokenizer, token_bytes, token_text
from scheduler.wire.messages import TokenOut

# The fields every choice of an answer carries, streamed or not: ``index``, ``finish_reason``,
# OpenAI's ``logprobs`` (completions' and chat's forms) and, when asked, the token ids.

def choice_fields(job: Job, choice: Choice, body: dict, got: Delta | Collected,
                  tokenizer: Any | None, with_prompt_ids: bool) -> dict:
    """One choice of an answer: ``body`` (text, message or delta) with the common fields."""
    out = {"index": choice.index, **body, "finish_reason": got.finish_reason,
           "logprobs": _logprobs(job, choice, got, tokenizer) if job.logprobs else None}
    if job.return_token_ids:
        out["token_ids"] = got.token_ids
        if with_prompt_ids:
            out["prompt_token_ids"] = choice.prompt_ids
    return out


def _logprobs(job: Job, choice: Choice, got: Delta | Collected, tokenizer: Any | None
              ) -> dict:
    """OpenAI's ``logprobs`` of the generated tokens, under the model (temperature 1).
    Completions: token texts, their logprobs, maps text -> logprob of the likeliest tokens and
    the sampled one (up to k + 1 entries, most likely first), and each token's offset in the
    completion.  Chat: ``content``, one entry per token with its k likeliest alternatives.
    A token that holds part of a character is written ``bytes:\\xNN``; tokens are their ids as
    strings when there is no tokenizer."""
    def raw(token_id: int) -> bytes:
        return str(token_id).encode() if tokenizer is None else token_bytes(tokenizer, token_id)

    tops = zip(got.top_ids or [[]] * len(got.token_ids),
               got.top_logprobs or [[]] * len(got.token_ids), strict=True)
    if job.is_chat:
        def entry(token_id: int, logprob: float) -> dict:
            b = raw(token_id)
            return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(*p) for p in zip(*top)]}
                            for t, lp, top in zip(got.token_ids, got.logprobs, tops)]}
    entries = list(zip(got.token_ids, got.logprobs, tops))
    if got.echo_ids:  # the prompt's first token has no logprob (nothing predicts it)
        num = len(got.echo_ids) - 1
        echo_tops = zip(got.echo_top_ids or [[]] * num, got.echo_top_logprobs or [[]] * num,
                        strict=True)
        prompt = list(zip(got.echo_ids[1:], got.echo_logprobs or [None] * num, echo_tops))
        entries = [(got.echo_ids[0], None, None), *prompt, *entries]
    maps: list[dict | None] = []
    for t, lp, top in entries:
        if lp is None:
            maps.append(None)
            continue
        ranked = sorted({**dict(zip(*top)), t: lp}.items(), key=lambda p: -p[1])
        maps.append({})
        for token_id, logprob in ranked:
            maps[-1].setdefault(token_text(raw(token_id)), logprob)
    return {"tokens": [token_text(raw(t)) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": maps,
            "text_offset": [choice.offsets.step(raw(t)) for t, _, _ in entries]}


# Frames of every choice -> text deltas, merged, for the SSE (``sse_frames``) and JSON
# (``complete_body``) answers of the generation routes.
#
# One HTTP request runs one engine request per choice (``n`` samples of each prompt of a batch).
# A choice: ``engine.generate`` frames -> ``IncrementalDetokenizer`` -> deltas; the choices' deltas
# are merged as they come into SSE chunks (one choice each, with its ``index``) or one JSON body
# (choices in index order).  Leaving a frame iterator early (stop string matched, client gone, a
# sibling choice failed) aborts its request at the scheduler, so every iterator is closed with
# ``aclosing`` and every choice task is cancelled and awaited: the aborts go out at once, not at
# garbage collection.  Latency and outcome go to ``Metrics``, per choice.
#
# Prompt sharing: the samples j > 0 of a prompt are sent only once sample 0 has its first frame.
# By then the scheduler has prefilled the prompt and stored its checkpoint at ``prompt_len - 1``
# (inserted into the tree when that prefill step's result comes back, before the step that
# samples the first token), so the other samples restore it instead of prefilling n times.

def engine_down(reason: str) -> RequestError:
    return RequestError(f"the engine is down: {reason}", status=503, type="server_error",
                        code="engine_dead")


async def choice_deltas(engine: EngineClient, tokenizer: Any | None, job: Job, choice: Choice
                        ) -> AsyncIterator[Delta]:
    """Text deltas of one choice; raises RequestError if it is refused or the engine dies."""
    detok = IncrementalDetokenizer(tokenizer, job.stop, choice.prompt_ids)
    primed = job.primed.get(choice.prompt_index) if job.share_prompts else None
    if primed is not None and choice.sample_index > 0:
        await primed.wait()
    finish, echoed = None, not job.echo
    try:
        frames = engine.generate(choice.rid, choice.prompt_ids, choice.sampling)
        async with aclosing(frames):
            async for out in frames:
                if choice.sample_index == 0 and primed is not None:
                    primed.set()
                if out.finish_reason == "error":
                    if engine.dead is not None:
                        raise engine_down(engine.dead)
                    raise RequestError(out.error or "the scheduler refused the request")
                if choice.echo_only:
                    out = replace(out, token_ids=[], logprobs=[], top_ids=[], top_logprobs=[],
                                  finish_reason="length" if out.finished else None)
                if out.token_ids and not choice.num_completion_tokens:
                    job.metrics.ttft.observe(time.perf_counter() - job.arrived)
                choice.num_completion_tokens += len(out.token_ids)
                choice.num_cached_tokens = max(choice.num_cached_tokens, out.cached_tokens)
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
                delta = Delta(text, list(out.token_ids), list(out.logprobs), finish,
                              list(out.top_ids), list(out.top_logprobs))
                if not echoed:
                    echoed = True
                    _echo(delta, out, choice.prompt_ids, tokenizer)
                yield delta
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
        if choice.sample_index == 0 and primed is not None:
            primed.set()  # whatever happened, the other samples need not wait any longer
        if finish is None:  # the consumer left before the end: the request was aborted
            job.metrics.aborted.inc()


def _echo(delta: Delta, out: TokenOut, prompt_ids: list[int], tokenizer: Any | None) -> None:
    """Put the prompt before the first delta: its text (none without a tokenizer), its ids
    and the prompt logprobs its frame carries."""
    if tokenizer is not None:
        delta.text = tokenizer.decode(prompt_ids, skip_special_tokens=True) + delta.text
    delta.echo_ids = list(prompt_ids)
    delta.echo_logprobs = list(out.prompt_logprobs)
    delta.echo_top_ids = list(out.prompt_top_ids)
    delta.echo_top_logprobs = list(out.prompt_top_logprobs)


async def all_deltas(engine: EngineClient, tokenizer: Any | None, job: Job
                     ) -> AsyncIterator[tuple[Choice, Delta]]:
    """Every choice's deltas, merged as they arrive.  The first choice to fail ends the whole
    request (its error is raised, the others are aborted), as does leaving early."""
    if len(job.choices) == 1:
        choice = job.choices[0]
        async with aclosing(choice_deltas(engine, tokenizer, job, choice)) as deltas:
            async for delta in deltas:
                yield choice, delta
        return
    job.primed = {c.prompt_index: asyncio.Event() for c in job.choices}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with aclosing(choice_deltas(engine, tokenizer, job, choice)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((choice, delta))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((choice, e))
            return
        queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in job.choices]
    try:
        num_running = len(tasks)
        while num_running:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                num_running -= 1
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let the aborts go out


# The streamed (SSE) answer of a generation request: one chunk per choice's delta as they come,
# the usage chunk when asked, ``[DONE]``; chat streams split reasoning (``reasoning_content``)
# and tool calls out of the text.

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


# The JSON (non-streamed) answer of a generation request: every choice's deltas collected,
# the best ``n`` of ``best_of`` kept, chat tool calls split from the content; and the wait that
# cancels the request when the client disconnects first.

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
