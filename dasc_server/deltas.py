"""Frames of every choice -> text deltas, merged, for the SSE (sse_response.py) and JSON
(json_response.py) answers of the generation routes.

One HTTP request runs one engine request per choice (``n`` samples of each prompt of a batch).
A choice: ``engine.generate`` frames -> ``IncrementalDetokenizer`` -> deltas; the choices' deltas
are merged as they come into SSE chunks (one choice each, with its ``index``) or one JSON body
(choices in index order).  Leaving a frame iterator early (stop string matched, client gone, a
sibling choice failed) aborts its request at the scheduler, so every iterator is closed with
``aclosing`` and every choice task is cancelled and awaited: the aborts go out at once, not at
garbage collection.  Latency and outcome go to ``Metrics``, per choice.

Prompt sharing: the samples j > 0 of a prompt are sent only once sample 0 has its first frame.
By then the scheduler has prefilled the prompt and stored its checkpoint at ``prompt_len - 1``
(inserted into the tree when that prefill step's result comes back, before the step that
samples the first token), so the other samples restore it instead of prefilling n times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from dasc_server.detokenizer import IncrementalDetokenizer
from dasc_server.engine_client import EngineClient, EngineDead
from dasc_server.jobs import Choice, Delta, Job
from dasc_server.request_errors import RequestError
from scheduler.wire.messages import TokenOut


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
