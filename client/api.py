"""Synchronous client: one ``httpx.Client`` (a keep-alive pool) per ``DascClient``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from client.protocol import CHAT, COMPLETIONS, parse_completion, request_body, stream_events
from client.sse import iter_sse_json
from client.transport import DEFAULT_BASE_URL, check, client_options, json_body, transport_errors
from client.types import Completion, StreamEvent


class DascClient:
    """Blocking client for the dasc server.  Every failure (HTTP error status, error frame,
    refused connection, timeout, truncated stream) raises ``DascError``.

    Streams are generators: the POST goes out at the first ``next()``, so a TTFT clock started
    just before iterating includes it.  Leaving a stream early closes its connection.
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = 600.0, *, model: str | None = None,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.model = model  # sent as "model" when set
        self._http = httpx.Client(**client_options(base_url, api_key, timeout, max_connections))

    def __enter__(self) -> DascClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        """True when ``/health`` answers 2xx (False for e.g. 503 while starting)."""
        with transport_errors(self.base_url + "/health"):
            return self._http.get("/health").is_success

    def models(self) -> list[str]:
        """Ids of the served models (``/v1/models``)."""
        data = json_body(self._request("GET", "/v1/models")).get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and "id" in m]

    def flush_cache(self) -> None:
        """Empty the server's prefix cache."""
        self._request("POST", "/flush_cache")

    def complete(self, prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0,
                 **extra: Any) -> Completion:
        body = request_body("prompt", prompt, max_tokens, temperature, extra,
                            model=self.model, stream=False)
        return parse_completion(json_body(self._request("POST", COMPLETIONS, body)),
                                is_chat=False)

    def stream(self, prompt: str | list[int], max_tokens: int = 16, temperature: float = 0.0,
               **extra: Any) -> Iterator[StreamEvent]:
        body = request_body("prompt", prompt, max_tokens, temperature, extra,
                            model=self.model, stream=True)
        return self._stream(COMPLETIONS, body, is_chat=False)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 16,
             temperature: float = 0.0, **extra: Any) -> Completion:
        body = request_body("messages", messages, max_tokens, temperature, extra,
                            model=self.model, stream=False)
        return parse_completion(json_body(self._request("POST", CHAT, body)), is_chat=True)

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int = 16,
                    temperature: float = 0.0, **extra: Any) -> Iterator[StreamEvent]:
        body = request_body("messages", messages, max_tokens, temperature, extra,
                            model=self.model, stream=True)
        return self._stream(CHAT, body, is_chat=True)

    def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        with transport_errors(self.base_url + path):
            return check(self._http.request(method, path, json=body))

    def _stream(self, path: str, body: dict, *, is_chat: bool) -> Iterator[StreamEvent]:
        with transport_errors(self.base_url + path), \
                self._http.stream("POST", path, json=body) as response:
            if response.is_error:
                response.read()
                check(response)
            for frame in iter_sse_json(response.iter_bytes(), require_done=True):
                yield from stream_events(frame, is_chat=is_chat)
