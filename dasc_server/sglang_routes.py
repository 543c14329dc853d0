"""SGLang's native worker routes, so the SGLang model gateway (``smg``) can use dasc-serve as a
worker: ``GET /model_info`` (and the older ``/get_model_info``), ``GET /get_server_info``,
``GET /health_generate`` and ``POST /generate``.

``/generate`` takes SGLang's body (``sglang_request.NativeGenerateRequest``), turns it into the
completions request it means and runs it on the OpenAI routes' path (``prepare`` -> ``Job`` ->
``engine.generate``), so validation, metrics, aborts and the prefix cache are the same.  Its
answer is SGLang's: ``{"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens,
completion_tokens, cached_tokens, e2e_latency}}``; streamed, every ``data: {...}`` frame holds
the text and ids so far (SGLang's default, non-incremental), then ``data: [DONE]``.

The gateway (0.3.2) also opens HTTP/2 prior-knowledge connections (``PRI * HTTP/2.0``) to
probe for SGLang's and vLLM's gRPC workers; uvicorn speaks HTTP/1.1 only and logs ``Invalid
HTTP request received`` once per probe at registration.  The gateway then picks HTTP.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from dasc_server.completion_request import CompletionRequest
from dasc_server.deltas import choice_deltas
from dasc_server.engine_client import EngineClient
from dasc_server.jobs import Job
from dasc_server.json_response import finished_before_disconnect
from dasc_server.request_errors import RequestError
from dasc_server.sglang_request import NativeGenerateRequest
from dasc_server.sse_response import DONE_FRAME

HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(slots=True)
class _Output:
    """What one native request has produced so far."""

    rid: str
    prompt_len: int
    arrived: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None

    def body(self) -> dict:
        num_completion = len(self.output_ids)
        if self.finish_reason == "length":
            finish = {"type": "length", "length": num_completion}
        elif self.finish_reason is None:
            finish = None
        else:
            finish = {"type": self.finish_reason, "matched": None}
        meta = {"id": self.rid, "finish_reason": finish, "prompt_tokens": self.prompt_len,
                "completion_tokens": num_completion, "cached_tokens": self.cached_tokens,
                "e2e_latency": time.perf_counter() - self.arrived}
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def _version() -> str:
    try:
        return version("dasc")
    except PackageNotFoundError:
        return "unknown"


def _model_type(model_path: str) -> str | None:
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def add_native_routes(app: FastAPI, engine: EngineClient, tokenizer: Any | None,
                      model_name: str, prepare: Callable[[CompletionRequest], Awaitable[Job]],
                      max_in_flight: int) -> None:
    """Add the native routes; ``prepare`` is the OpenAI routes' request -> ``Job`` step."""
    info, model = engine.info.rank, engine.info.config.model
    model_info = {
        "model_path": model, "tokenizer_path": model if tokenizer else None,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": _model_type(model), "architectures": [info.model_type]}

    async def admit(req: CompletionRequest) -> Job:
        job = await prepare(req)
        if engine.num_active + len(job.choices) > max_in_flight:
            raise RequestError(f"the server is at capacity ({max_in_flight} requests in "
                               "flight); retry later", status=503, type="server_error",
                               code="overloaded", headers={"Retry-After": "1"})
        return job

    async def outputs(job: Job) -> AsyncIterator[_Output]:
        """The output after every delta of the job's single choice."""
        choice = job.choices[0]
        out = _Output(choice.rid, len(choice.prompt_ids), job.arrived)
        async with aclosing(choice_deltas(engine, tokenizer, job, choice)) as deltas:
            async for delta in deltas:
                out.text += delta.text
                out.output_ids += delta.token_ids
                out.cached_tokens = choice.num_cached_tokens
                out.finish_reason = delta.finish_reason
                yield out

    async def last_output(job: Job) -> _Output:
        last = None
        async with aclosing(outputs(job)) as it:
            async for out in it:
                last = out
        return last

    async def sse(job: Job) -> AsyncIterator[str]:
        try:
            async with aclosing(outputs(job)) as it:
                async for out in it:
                    yield f"data: {json.dumps(out.body(), ensure_ascii=False)}\n\n"
        except RequestError as e:
            yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"
        yield DONE_FRAME

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return model_info

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return {**engine.info.as_json(), "model_path": model,
                "tokenizer_path": model_info["tokenizer_path"], "served_model_name": model_name,
                "dp_size": 1, "version": _version()}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a one-token greedy request has gone through the scheduler and ranks."""
        probe = CompletionRequest(prompt=[info.eos_token_id or 0], max_tokens=1,
                                  temperature=0.0)
        try:
            await asyncio.wait_for(last_output(await admit(probe)), HEALTH_GENERATE_TIMEOUT_S)
        except (RequestError, asyncio.TimeoutError) as e:
            reason = e.message if isinstance(e, RequestError) else "timed out"
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(req: NativeGenerateRequest, request: Request) -> Response:
        try:
            completion = req.completion_request()
        except ValidationError as e:  # a value the OpenAI route bounds tighter
            raise RequestValidationError(e.errors()) from e
        job = await admit(completion)
        if req.stream:
            return StreamingResponse(sse(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        task = asyncio.ensure_future(last_output(job))
        if not await finished_before_disconnect(task, request):
            return Response(status_code=499)
        return JSONResponse(task.result().body())
