"""Asynchronous client: one ``httpx.AsyncClient`` (a keep-alive pool) per ``AsyncDascClient``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from client.protocol import CHAT, COMPLETIONS, parse_completion, request_body, stream_events
from client.sse import aiter_sse_json
from client.transport import DEFAULT_BASE_URL, check, client_options, json_body, transport_errors
from client.types import Completion, StreamEvent


class AsyncDascClient:
    """``DascClient`` for asyncio: same methods, awaited; streams are async iterators.
    ``max_connections`` should be at least the number of concurrent requests.  A stream left
    early keeps its connection until the generator is closed (``contextlib.aclosing``)."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 600.0, *, model: str | None = None,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.AsyncClient(
            **client_options(base_url, api_key, timeout, max_connections))

    async def __aenter__(self) -> AsyncDascClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self) -> bool:
        with transport_errors(self.base_url + "/health"):
            return (await self._http.get("/health")).is_success

    async def models(self) -> list[str]:
        data = json_body(await self._request("GET", "/v1/models")).get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and "id" in m]

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def complete(self, prompt: str | list[int], max_tokens: int = 16,
                       temperature: float = 0.0, **extra: Any) -> Completion:
        body = request_body("prompt", prompt, max_tokens, temperature, extra,
                            model=self.model, stream=False)
        return parse_completion(json_body(await self._request("POST", COMPLETIONS, body)),
                                is_chat=False)

    def stream(self, prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0,
               **extra: Any) -> AsyncIterator[StreamEvent]:
        body = request_body("prompt", prompt, max_tokens, temperature, extra,
                            model=self.model, stream=True)
        return self._stream(COMPLETIONS, body, is_chat=False)

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int = 16,
                   temperature: float = 0.0, **extra: Any) -> Completion:
        body = request_body("messages", messages, max_tokens, temperature, extra,
                            model=self.model, stream=False)
        return parse_completion(json_body(await self._request("POST", CHAT, body)),
                                is_chat=True)

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int = 16,
                    temperature: float = 0.0, **extra: Any) -> AsyncIterator[StreamEvent]:
        body = request_body("messages", messages, max_tokens, temperature, extra,
                            model=self.model, stream=True)
        return self._stream(CHAT, body, is_chat=True)

    async def _request(self, method: str, path: str, body: dict | None = None
                       ) -> httpx.Response:
        with transport_errors(self.base_url + path):
            return check(await self._http.request(method, path, json=body))

    async def _stream(self, path: str, body: dict, *, is_chat: bool
                      ) -> AsyncIterator[StreamEvent]:
        with transport_errors(self.base_url + path):
            async with self._http.stream("POST", path, json=body) as response:
                if response.is_error:
                    await response.aread()
                    check(response)
                async for frame in aiter_sse_json(response.aiter_bytes(), require_done=True):
                    for event in stream_events(frame, is_chat=is_chat):
                        yield event
