"""The OpenAI-compatible HTTP front end: ``create_app(engine, tokenizer, model_name, options)``.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or SSE with
``"stream": true``), ``GET /health``, ``GET /v1/models``, ``GET /server_info``, ``GET /metrics``
(Prometheus), ``GET /v1/stats`` (JSON), ``POST /flush_cache``, ``POST /tokenize`` and
``POST /detokenize``, and SGLang's native routes.  A chat answer of a model whose template reasons
(``<think>``) carries ``reasoning_content`` (``dasc_server.chat``).  Every route but ``/health``
needs ``Authorization: Bearer KEY`` when an API key is set (``dasc_server.middleware``).

A request: validate (``dasc_server.requests``) -> prompt ids -> ``SamplingParams`` -> a ``Job``
-> ``sse_frames`` or ``complete_body`` (``dasc_server.responses``).
Beyond ``max_running_requests + max_queued_requests`` requests in flight the server answers 503
with ``Retry-After`` instead of queueing without bound.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from dasc_server.chat import (
    ReasoningStream,
    ToolPlan,
    chat_prompt_ids,
    has_reasoning_format,
    prompt_opens_reasoning,
    render_chat,
    tool_plan,
)
from dasc_server.engine_client import Choice, EngineClient, EngineDead, Job
from dasc_server.flags import FrontEndOptions
from dasc_server.metrics import CONTENT_TYPE, Metrics
from dasc_server.middleware import Guards
from dasc_server.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NativeGenerateRequest,
    RequestError,
    check_model,
    check_prompt,
    error_body,
    response_format_grammar,
    validation_error_body,
)
from dasc_server.responses import (
    DONE_FRAME,
    choice_deltas,
    complete_body,
    engine_down,
    finished_before_disconnect,
    sse_frames,
)
from dasc_server.tokenizer import TokenizerThreads
from scheduler.wire.messages import SamplingParams

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def check_capacity(engine: EngineClient, job: Job, max_in_flight: int) -> None:
    """503 with ``Retry-After`` when the job's choices would take the requests in flight past
    ``max_in_flight`` (``--max-running-requests + --max-queued-requests``)."""
    if engine.num_active + len(job.choices) > max_in_flight:
        raise RequestError(f"the server is at capacity ({max_in_flight} requests in flight); "
                           "retry later", status=503, type="server_error", code="overloaded",
                           headers={"Retry-After": "1"})


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """Sample j of a prompt draws with ``seed + j`` (mod 2**63), so sample 0 repeats the n=1
    request with that seed; no seed: the scheduler draws one per sample."""
    return None if seed is None else (seed + sample_index) % 2**63


def create_app(engine: EngineClient, tokenizer: Any | None, model_name: str,
               options: FrontEndOptions | None = None) -> FastAPI:
    """The HTTP app over a started ``EngineClient``.

    ``tokenizer`` (a transformers tokenizer, or None) must offer ``encode(text,
    add_special_tokens=False)``, ``decode(ids, skip_special_tokens=True)`` and, if it has a
    ``chat_template``, ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``.
    """
    options = options or FrontEndOptions()
    app = FastAPI(title="dasc", docs_url=None, redoc_url=None)
    app.add_middleware(Guards, api_key=options.api_key, max_body=options.max_request_bytes)
    metrics = Metrics(engine.info)
    scheduling = engine.info.config.scheduling
    max_in_flight = scheduling.max_running_requests + options.max_queued_requests

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing errors as OpenAI words them: ``Invalid URL (POST /v1/responses)``."""
        where = f"({request.method} {request.url.path})"
        if exc.status_code == 404:
            message = f"Invalid URL {where}"
        elif exc.status_code == 405:
            message = f"Method not allowed {where}"
        else:
            message = f"{exc.detail} {where}"
        return JSONResponse(error_body(message), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crashed(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       type="server_error"), status_code=500)

    reasons = has_reasoning_format(tokenizer)  # the template writes <think>...</think>
    threads = TokenizerThreads(tokenizer, engine.info.rank.max_context_len)
    metrics.preparing.set_function(lambda: threads.in_flight)
    app.router.on_shutdown.append(threads.shutdown)

    def prompt_batch(req: CompletionRequest | ChatCompletionRequest,
                     tools: ToolPlan | None = None) -> tuple[list[list[int]], bool | None]:
        """Each prompt's token ids (a chat request is one prompt) and, for a chat whose
        template reasons, whether the prompt leaves the answer inside ``<think>``."""
        tok = threads.here()
        if isinstance(req, ChatCompletionRequest):
            text = render_chat(tok, req.messages, tools and tools.tools, req.chat_template_kwargs)
            threads.check_fits(text, "messages")
            ids = list(tok.encode(text, add_special_tokens=False))
            return [ids], prompt_opens_reasoning(text) if reasons else None
        batch = []
        for i, p in enumerate(req.prompts):
            if isinstance(p, str):
                threads.check_fits(p, "prompt" if len(req.prompts) == 1 else f"prompt {i}")
                batch.append(list(tok.encode(p, add_special_tokens=False)))
            else:
                batch.append(list(p))
        return batch, None

    def prepare(req: CompletionRequest | ChatCompletionRequest) -> Job:
        check_model(req.model, model_name)
        if engine.dead is not None:
            raise engine_down(engine.dead)
        is_chat = isinstance(req, ChatCompletionRequest)
        param = "messages" if is_chat else "prompt"
        prompts = [] if is_chat else req.prompts
        needs_text = is_chat or any(isinstance(p, str) for p in prompts) or bool(req.stop_strings)
        if needs_text and tokenizer is None:
            raise RequestError("the model folder has no tokenizer: send the prompt as token ids "
                               "and no stop strings", param="stop" if req.stop_strings else param)
        num_prompts = 1 if is_chat else len(prompts)
        num_samples = req.num_samples
        if num_prompts * num_samples > max_in_flight:
            raise RequestError(
                f"{num_prompts} prompt(s) x {num_samples} samples = {num_prompts * num_samples} "
                f"choices; at most {max_in_flight} (--max-running-requests + "
                "--max-queued-requests)",
                param=("best_of" if req.best_of else "n") if num_samples > 1 else "prompt")
        info = engine.info.rank
        stop_token_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < info.vocab_size for t in stop_token_ids):
            raise RequestError(f"stop_token_ids must lie in [0, {info.vocab_size})",
                               param="stop_token_ids")
        bias = req.token_bias
        if any(not 0 <= t < info.vocab_size for t in bias):
            raise RequestError(f"logit_bias token ids must lie in [0, {info.vocab_size})",
                               param="logit_bias")
        echo = not is_chat and bool(req.echo)
        # echo with max_tokens 0 (lm-eval's scoring): the prompt and its logprobs only; the
        # engine samples one token (in the prefill step that ends the prompt) that is dropped
        echo_only = echo and req.max_tokens == 0
        if req.requested_max_tokens == 0 and not echo_only:
            raise RequestError("max_tokens must be at least 1 (0 only with echo)",
                               param="max_tokens")
        grammar = response_format_grammar(req.response_format)
        tools = tool_plan(req, tokenizer) if is_chat else None
        if tools is not None and tools.grammar:
            if grammar:
                raise RequestError("response_format and forced tool calls cannot both "
                                   "constrain the output", param="response_format")
            grammar = tools.grammar
        if grammar and tokenizer is None:
            raise RequestError("the model folder has no tokenizer, which a grammar needs",
                               param="tools" if tools and tools.grammar else "response_format")
        if grammar and (req.ignore_eos or info.eos_token_id is None):
            raise RequestError("response_format needs the model's EOS to end the output "
                               "(no ignore_eos)", param="ignore_eos" if req.ignore_eos
                               else "response_format")
        choices = []
        prompts_ids, in_reasoning = prompt_batch(req, tools)
        for prompt_index, prompt_ids in enumerate(prompts_ids):
            try:
                max_tokens = check_prompt(prompt_ids, 1 if echo_only else req.requested_max_tokens,
                                          param=param,
                                          vocab_size=info.vocab_size,
                                          max_context_len=info.max_context_len,
                                          max_total_tokens=scheduling.max_total_tokens)
            except RequestError as e:
                if num_prompts > 1:
                    e.message = f"prompt {prompt_index}: {e.message}"
                raise
            if req.min_tokens > max_tokens:
                raise RequestError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens "
                                   f"({max_tokens})", param="min_tokens")
            for sample_index in range(num_samples):
                sampling = SamplingParams(
                    max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=max(req.top_k, 0), seed=sample_seed(req.seed, sample_index),
                    stop_token_ids=stop_token_ids, ignore_eos=req.ignore_eos,
                    logit_bias=bias, presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                    top_logprobs=req.num_top_logprobs, logprobs=req.wants_logprobs,
                    prompt_logprobs=echo and req.wants_logprobs,
                    grammar=grammar)
                choices.append(Choice(
                    prompt_index * num_samples + sample_index, prompt_index, sample_index,
                    engine.new_rid(), prompt_ids, sampling,
                    tool_calls=tools.stream() if tools and tools.parses_calls else None,
                    # a grammar shapes the answer from its first token: that is content
                    reasoning=None if in_reasoning is None else ReasoningStream(
                        in_reasoning and not grammar),
                    echo_only=echo_only))
        return Job(is_chat=is_chat, id=choices[0].rid, model=model_name, choices=choices,
                   stop=req.stop_strings,
                   return_token_ids=req.return_token_ids or tokenizer is None,
                   include_usage=req.include_usage, created=int(time.time()),
                   metrics=metrics, arrived=time.perf_counter(),
                   logprobs=req.wants_logprobs, echo=echo,
                   share_prompts=scheduling.prefix_cache, num_returned=req.n)

    async def prepare_off_loop(req: CompletionRequest | ChatCompletionRequest) -> Job:
        return await threads.run(prepare, req)

    async def serve(req: CompletionRequest | ChatCompletionRequest, request: Request
                    ) -> Response:
        job = await prepare_off_loop(req)
        check_capacity(engine, job, max_in_flight)
        if req.stream:
            return StreamingResponse(sse_frames(engine, tokenizer, job),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        task = asyncio.ensure_future(complete_body(engine, tokenizer, job))
        if not await finished_before_disconnect(task, request):
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
                "max_model_len": engine.info.rank.max_context_len}
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    async def server_info() -> dict:
        """The engine's facts; ``model_path`` and ``served_model_name`` under SGLang's names too,
        which the SGLang model gateway reads to name the model and load its tokenizer."""
        model = engine.info.config.model
        return {**engine.info.as_json(), "model_path": model, "tokenizer_path": model,
                "served_model_name": model_name}

    async def scheduler_stats():
        try:
            return await engine.stats()
        except (EngineDead, OSError) as e:
            raise engine_down(str(e)) from e

    @app.get("/v1/stats")
    async def stats() -> dict:
        """Pool occupancy, counters, step timing and a fresh integrity check (JSON)."""
        return {**asdict(await scheduler_stats()), "num_preparing": threads.in_flight}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(await scheduler_stats()), media_type=CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        try:
            done = await engine.flush_cache()
        except (EngineDead, OSError) as e:  # OSError: the pipe broke before the reader saw it
            raise engine_down(str(e)) from e
        return JSONResponse({"ok": done.ok, "message": done.message},
                            status_code=200 if done.ok else 400)

    add_native_routes(app, engine, tokenizer, model_name, prepare_off_loop, max_in_flight)
    add_tokenize_routes(app, threads, model_name, engine.info.rank.vocab_size)
    return app


# ``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them (its ``bench serve`` asks
# for ``/tokenize`` and warns on a 404).
#
# ``/tokenize`` takes a ``prompt`` (text, ``add_special_tokens`` as vLLM: default true) or chat
# ``messages`` (rendered as ``/v1/chat/completions`` renders them, with the open assistant turn)
# and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
# ``tokens`` and answers ``{"prompt"}``.  A server without a tokenizer answers 400 for both.

class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, threads: TokenizerThreads, model_name: str,
                        vocab_size: int) -> None:
    """Both routes encode and decode in ``threads``' pool, off the event loop."""

    def needs_tokenizer(param: str) -> None:
        if threads.tokenizer is None:
            raise RequestError("this server has no tokenizer (it serves token ids only)",
                               param=param)

    def encode(req: TokenizeRequest) -> dict:
        tok = threads.here()
        if req.messages is not None:
            ids = chat_prompt_ids(tok, req.messages, template_kwargs=req.chat_template_kwargs)
        else:
            threads.check_fits(req.prompt, "prompt")
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": threads.max_context_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model, model_name)
        needs_tokenizer("messages" if req.messages is not None else "prompt")
        return await threads.run(encode, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model, model_name)
        needs_tokenizer("tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                               param="tokens")
        return {"prompt": await threads.run(lambda: threads.here().decode(req.tokens))}


# SGLang's native worker routes, so the SGLang model gateway (``smg``) can use dasc-serve as a
# worker: ``GET /model_info`` (and the older ``/get_model_info``), ``GET /get_server_info``,
# ``GET /health_generate`` and ``POST /generate``.
#
# ``/generate`` takes SGLang's body (``requests.NativeGenerateRequest``), turns it into the
# completions request it means and runs it on the OpenAI routes' path (``prepare`` -> ``Job`` ->
# ``engine.generate``), so validation, metrics, aborts and the prefix cache are the same.  Its
# answer is SGLang's: ``{"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens,
# completion_tokens, cached_tokens, e2e_latency}}``; streamed, every ``data: {...}`` frame holds
# the text and ids so far (SGLang's default, non-incremental), then ``data: [DONE]``.
#
# The gateway (0.3.2) also opens HTTP/2 prior-knowledge connections (``PRI * HTTP/2.0``) to
# probe for SGLang's and vLLM's gRPC workers; uvicorn speaks HTTP/1.1 only and logs ``Invalid
# HTTP request received`` once per probe at registration.  The gateway then picks HTTP.

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
        check_capacity(engine, job, max_in_flight)
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
                                     headers=SSE_HEADERS)
        task = asyncio.ensure_future(last_output(job))
        if not await finished_before_disconnect(task, request):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(task.result().body())
