"""One streaming completion, timed client-side, and the few admin calls the protocols need.

Clocks (all ``perf_counter``, started just before the POST, as vLLM and SGLang do):
    ttfb  first SSE data event of any kind (vLLM's "first chunk"); the events are read by
          ``client.sse.SSEDecoder``, the parser the Python client uses
    ttft  first frame that carries generated content: non-empty ``text`` / ``delta.content`` /
          ``token_ids``.  Role-only and usage-only frames do not count (SGLang's rule).
    itl   gaps between successive content frames; e2el: until ``[DONE]`` or the stream's end.
Usage comes from the final ``stream_options.include_usage`` frame; a server that does not
report ``prompt_tokens_details.cached_tokens`` leaves ``cached_tokens`` None ("not reported").

The client is aiohttp, as in vLLM's and SGLang's serving benchmarks.  httpx's pool (httpcore)
scans every pooled connection, polling each socket, whenever a request starts or ends: at
concurrency 32 a streamed request cost the client 5.5-6.5 ms of CPU, aiohttp 0.5 ms.  On a
small machine shared with the server that client was the bottleneck of every TTFT it reported.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from client.sse import SSEDecoder
from loadgen.workload import Request


@dataclass(slots=True)
class RequestResult:
    ttft_ms: float | None = None
    ttfb_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None
    start_s: float = 0.0  # send time relative to the window's start
    tags: dict = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)  # the reply, when asked for its ids

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        if self.error or self.output_tokens < 2 or self.ttft_ms is None:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)

    def as_json(self) -> dict:
        return {"ttft_ms": _r(self.ttft_ms), "ttfb_ms": _r(self.ttfb_ms),
                "e2el_ms": _r(self.e2el_ms), "tpot_ms": _r(self.tpot_ms),
                "itl_ms": [_r(x) for x in self.itl_ms], "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "error": self.error, "start_s": round(self.start_s, 4), **self.tags}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# What a request can fail with: transport, timeout, a line past the read buffer (ValueError),
# or a frame that is not JSON (json.JSONDecodeError, a ValueError too).
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError)


def make_client(base_url: str, concurrency: int, api_key: str | None = None,
                timeout: float | None = 600.0) -> aiohttp.ClientSession:
    """One keep-alive pool with a connection per concurrent request (a smaller pool would
    queue requests in the client and throttle the load).  ``timeout``: the longest wait for
    the next bytes of a response, as httpx's read timeout (None: no limit).  Paths are relative
    to ``base_url`` (``url_path``), so a base URL with a path prefix keeps it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/") + "/", headers=headers,
        connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout, sock_connect=60.0),
        read_bufsize=1 << 20)  # an SSE line may hold long logprob lists


def url_path(path: str) -> str:
    """``path`` relative to the session's base URL (aiohttp drops the base's own path for an
    absolute one)."""
    return path.lstrip("/")


def request_body(req: Request, model: str | None, ignore_eos: bool = True) -> dict:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if model:
        body["model"] = model
    if req.returns_ids:
        body["return_token_ids"] = True
    return body


def _has_content(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or choice.get("token_ids") or delta.get("content")
                or delta.get("reasoning_content"))


async def send_streaming(client: aiohttp.ClientSession, req: Request, model: str | None,
                         window_start: float) -> RequestResult:
    """Never raises for a failed request: the failure is the result's ``error``."""
    res = RequestResult(tags=dict(req.tags))
    if not isinstance(req.prompt, str):
        res.prompt_tokens = len(req.prompt)  # replaced by usage when the server reports it
    num_content = 0
    last = start = time.perf_counter()
    res.start_s = start - window_start
    try:
        async with client.post(url_path("/v1/completions"),
                               json=request_body(req, model)) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                res.error = f"HTTP {resp.status}: {_error_message(text)}"
                return res
            events = SSEDecoder()
            async for raw in resp.content:  # one line per item, the newline kept
                if events.is_done:
                    # Read on to the end of the body (the chunked terminator): a response
                    # left unread closes its connection instead of returning it to the pool.
                    continue
                data = events.feed_line(raw.decode(errors="replace").rstrip("\r\n"))
                now = time.perf_counter()
                if events.is_done:
                    res.e2el_ms = (now - start) * 1e3
                if data is None:
                    continue
                if res.ttfb_ms is None:
                    res.ttfb_ms = (now - start) * 1e3
                frame = json.loads(data)
                if frame.get("error"):
                    res.error = f"stream error: {_error_message(json.dumps(frame))}"
                    return res
                choices = frame.get("choices") or []
                if req.returns_ids:
                    for c in choices:
                        res.output_ids += c.get("token_ids") or []
                if any(_has_content(c) for c in choices):
                    if num_content == 0:
                        res.ttft_ms = (now - start) * 1e3
                    else:
                        res.itl_ms.append((now - last) * 1e3)
                    num_content += 1
                    last = now
                _read_usage(res, frame.get("usage"))
        if res.e2el_ms is None:
            res.e2el_ms = (time.perf_counter() - start) * 1e3
    except REQUEST_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.ttft_ms is None:
        res.error = "no generated content in the stream"
    elif not res.output_tokens:
        res.output_tokens = num_content  # usage not reported: one token per content frame
    return res


def _read_usage(res: RequestResult, usage: dict | None) -> None:
    if not usage:
        return
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens = usage["prompt_tokens"]
    if usage.get("completion_tokens") is not None:
        res.output_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = details["cached_tokens"]


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj)
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


class ServerAdmin:
    """Cache flush and telemetry over the same pool; each is None-safe for servers that lack
    the route (``/v1/stats`` and ``/server_info`` are dasc's; SGLang has ``/flush_cache``,
    vLLM ``/reset_prefix_cache``)."""

    def __init__(self, client: aiohttp.ClientSession):
        self.client = client

    async def _call(self, method: str, path: str) -> tuple[int, str]:
        """(status, body).  Admin calls are idempotent: retry a dropped connection twice."""
        for attempt in range(3):
            try:
                async with self.client.request(method, url_path(path)) as r:
                    return r.status, await r.text(errors="replace")
            except aiohttp.ClientConnectionError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    async def flush(self) -> None:
        for path in ("/flush_cache", "/reset_prefix_cache"):
            status, text = await self._call("POST", path)
            if status == 200:
                return
        raise RuntimeError(f"the server flushes no prefix cache: {status} {text}")

    async def get_json(self, path: str) -> dict | None:
        """None when the server has no such route; any other failure raises."""
        status, text = await self._call("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {_error_message(text)}")
        return json.loads(text)

    async def stats(self) -> dict | None:
        return await self.get_json("/v1/stats")

    async def server_info(self) -> dict | None:
        return await self.get_json("/server_info")
