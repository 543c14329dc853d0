"""The OpenAI-compatible HTTP front end: ``create_app(engine, tokenizer, model_name)``.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or SSE with
``"stream": true``), ``GET /health``, ``GET /v1/models``, ``GET /server_info``,
``POST /flush_cache``.

One generation request: validate (``protocol``) -> prompt ids -> ``SamplingParams`` ->
``engine.generate`` frames -> ``IncrementalDetokenizer`` -> response.  Leaving the frame
iterator early (stop string matched, client gone) aborts the request at the scheduler, so every
iterator is closed with ``aclosing``: the abort goes out at once, not at garbage collection.

Disconnects: for SSE, Starlette cancels the body iterator when the client leaves (it listens
for ``http.disconnect`` under ASGI spec < 2.4, as uvicorn reports), which cancels the wait in
``engine.generate``; for JSON responses a watcher task does the same.

SSE frames are ``data: {json}\\n\\n``, ending with ``data: [DONE]\\n\\n``.  A chat stream sends
``role`` with the first text, not in a text-less chunk of its own, so a client timing its first
chunk measures the first token.  Without a tokenizer only token-id prompts work and every
choice carries ``token_ids``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dasc_server.chat import chat_prompt_ids
from dasc_server.detokenizer import IncrementalDetokenizer
from dasc_server.engine_client import EngineClient, EngineDead
from dasc_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_model,
    check_prompt,
    validation_error_body,
)
from scheduler.messages import SamplingParams

DONE_FRAME = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


@dataclass(slots=True)
class _Job:
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
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # set on the last delta only


def create_app(engine: EngineClient, tokenizer: Any | None, model_name: str) -> FastAPI:
    """The HTTP app over a started ``EngineClient``.

    ``tokenizer`` (a transformers tokenizer, or None) must offer ``encode(text,
    add_special_tokens=False)``, ``decode(ids, skip_special_tokens=True)`` and, if it has a
    ``chat_template``, ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``.
    """
    app = FastAPI(title="dasc", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def prepare(req: CompletionRequest | ChatCompletionRequest) -> _Job:
        check_model(req.model, model_name)
        if engine.dead is not None:
            raise _engine_down(engine.dead)
        is_chat = isinstance(req, ChatCompletionRequest)
        param = "messages" if is_chat else "prompt"
        needs_text = is_chat or isinstance(req.prompt, str) or bool(req.stop_strings)
        if needs_text and tokenizer is None:
            raise RequestError("the model folder has no tokenizer: send the prompt as token ids "
                               "and no stop strings", param="stop" if req.stop_strings else param)
        if is_chat:
            prompt_ids = chat_prompt_ids(tokenizer, req.messages)
        elif isinstance(req.prompt, str):
            prompt_ids = list(tokenizer.encode(req.prompt, add_special_tokens=False))
        else:
            prompt_ids = list(req.prompt)
        info = engine.info
        max_tokens = check_prompt(prompt_ids, req.requested_max_tokens, param=param,
                                  vocab_size=info.vocab_size,
                                  max_context_len=info.max_context_len)
        stop_token_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < info.vocab_size for t in stop_token_ids):
            raise RequestError(f"stop_token_ids must lie in [0, {info.vocab_size})",
                               param="stop_token_ids")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=max(req.top_k, 0), seed=req.seed, stop_token_ids=stop_token_ids,
            ignore_eos=req.ignore_eos)
        return _Job(is_chat=is_chat, rid=engine.new_rid(), model=model_name,
                    prompt_ids=prompt_ids, sampling=sampling, stop=req.stop_strings,
                    return_token_ids=req.return_token_ids or tokenizer is None,
                    include_usage=req.include_usage, created=int(time.time()),
                    logprobs=not is_chat and req.logprobs is not None)

    async def serve(req: CompletionRequest | ChatCompletionRequest, request: Request
                    ) -> Response:
        job = prepare(req)
        if req.stream:
            return StreamingResponse(_sse(engine, tokenizer, job),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        task = asyncio.ensure_future(_complete(engine, tokenizer, job))
        if not await _finished_before_disconnect(task, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(task.result())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await serve(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await serve(req, request)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "reason": engine.dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "dasc",
                "max_model_len": engine.info.max_context_len}
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    async def server_info() -> dict:
        return asdict(engine.info)

    @app.get("/v1/stats")
    async def stats() -> dict:
        """Pool occupancy, counters, step timing and a fresh integrity check (JSON)."""
        try:
            return asdict(await engine.stats())
        except (EngineDead, OSError) as e:
            raise _engine_down(str(e)) from e

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        try:
            done = await engine.flush_cache()
        except (EngineDead, OSError) as e:  # OSError: the pipe broke before the reader saw it
            raise _engine_down(str(e)) from e
        return JSONResponse({"ok": done.ok, "message": done.message},
                            status_code=200 if done.ok else 400)

    return app


def _engine_down(reason: str) -> RequestError:
    return RequestError(f"the engine is down: {reason}", status=503, type="server_error",
                        code="engine_dead")


async def _deltas(engine: EngineClient, tokenizer: Any | None, job: _Job
                  ) -> AsyncIterator[_Delta]:
    """Text deltas of one request; raises RequestError if it is refused or the engine dies."""
    detok = IncrementalDetokenizer(tokenizer, job.stop, job.prompt_ids)
    try:
        async with aclosing(engine.generate(job.rid, job.prompt_ids, job.sampling)) as frames:
            async for out in frames:
                if out.finish_reason == "error":
                    if engine.dead is not None:
                        raise _engine_down(engine.dead)
                    raise RequestError(out.error or "the scheduler refused the request")
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
                yield _Delta(text, list(out.token_ids), list(out.logprobs), finish)
                if finish is not None:
                    return
    except (EngineDead, OSError) as e:
        raise _engine_down(engine.dead or str(e)) from e


def _sse_frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _choice(job: _Job, body: dict, finish_reason: str | None, token_ids: list[int],
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


def _chunk(job: _Job, delta: _Delta, is_first: bool) -> dict:
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


async def _sse(engine: EngineClient, tokenizer: Any | None, job: _Job) -> AsyncIterator[str]:
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


async def _complete(engine: EngineClient, tokenizer: Any | None, job: _Job) -> dict:
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


async def _finished_before_disconnect(task: asyncio.Future, request: Request) -> bool:
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
