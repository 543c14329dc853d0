"""ASGI middleware in front of every route: API key and request-size limit.

- ``api_key``: every path but ``/health`` needs ``Authorization: Bearer KEY``; compared with
  ``hmac.compare_digest`` (constant time); 401 otherwise.  The key is never logged.
- ``max_body``: a body over the limit gets 413, whether announced by ``Content-Length`` or
  streamed chunked; the body is read here first (it is bounded), so nothing of an oversized
  one reaches the route.
Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health",)


class Guards:
    def __init__(self, app, api_key: str | None = None, max_body: int = 16 * 1024 * 1024):
        self.app, self.max_body = app, max_body
        self._key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self._key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                return await _error(send, 401, "invalid or missing API key (send "
                                    "'Authorization: Bearer KEY')", "authentication_error",
                                    "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _error(send, 413, self._too_large(), "invalid_request_error",
                                "request_too_large")
        body, more = [], True
        while more:  # read the (bounded) body first: routes never see an oversized one
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_body:
                return await _error(send, 413, self._too_large(), "invalid_request_error",
                                    "request_too_large")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # after the body: only http.disconnect arrives

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_body} bytes (--max-request-bytes)"


async def _error(send, status: int, message: str, type: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
