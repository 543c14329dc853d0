"""Server-sent-events parsing for OpenAI-style streams, independent of any HTTP library.

``SSEDecoder`` turns bytes cut at arbitrary points into the ``data`` payloads of complete events
(WHATWG event-stream rules: ``data:`` with or without one space, several ``data`` lines joined by
``\\n``, ``:`` comment lines and other fields ignored, a blank line ends an event, ``\\n``,
``\\r\\n`` and ``\\r`` all end a line).  ``[DONE]`` ends the stream: nothing after it is returned.
``iter_sse_json`` adds the OpenAI layer: each payload is a JSON object, and an error frame raises
``DascError``.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from client.types import DascError

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")
_TRUNCATED = "stream ended before [DONE] (server or connection closed mid-answer)"


class SSEDecoder:
    """Incremental decoder: ``feed`` chunks, ``close`` at end of stream; both return payloads."""

    __slots__ = ("_utf8", "_partial", "_skip_lf", "_data", "is_done")

    def __init__(self) -> None:
        # utf-8-sig drops a leading byte-order mark; incremental so a character split across
        # chunks is decoded once both halves are in.
        self._utf8 = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
        self._partial = ""  # text after the last line terminator seen
        self._skip_lf = False  # the previous chunk ended in "\r": a leading "\n" belongs to it
        self._data: list[str] | None = None  # data lines of the event being read; None: none yet
        self.is_done = False  # [DONE] seen

    def feed(self, chunk: bytes | str) -> list[str]:
        if self.is_done:
            return []
        text = self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        if self._skip_lf and text:
            text = text[1:] if text.startswith("\n") else text
            self._skip_lf = False
        if text:
            self._skip_lf = text.endswith("\r")
        buf, start = self._partial + text, 0
        payloads: list[str] = []
        # Only CR / LF end lines: str.splitlines would also cut at U+2028 and friends, which
        # a JSON payload may carry unescaped.
        for match in _LINE_END.finditer(buf):
            payload = self.feed_line(buf[start:match.start()])
            start = match.end()
            if payload is not None:
                payloads.append(payload)
            if self.is_done:
                break
        self._partial = buf[start:]
        return payloads

    def feed_line(self, line: str) -> str | None:
        """One line without its terminator; returns a payload when the line ends an event."""
        if self.is_done:
            return None
        if not line:
            return self._dispatch()
        name, colon, value = line.partition(":")
        if name != "data":
            return None  # a ":" comment (empty name); event / id / retry: nothing OpenAI uses
        if colon and value.startswith(" "):
            value = value[1:]
        if self._data is None:
            self._data = []
        self._data.append(value)
        return None

    def close(self) -> list[str]:
        """End of stream.  Unlike the spec, a last event without its blank line is still
        delivered: a server that omits it should not lose its final frame."""
        tail = self._utf8.decode(b"", final=True)  # an incomplete character becomes U+FFFD
        return self.feed(tail + "\n\n")

    def _dispatch(self) -> str | None:
        if self._data is None:
            return None
        payload = "\n".join(self._data)
        self._data = None
        if payload.strip() == DONE:
            self.is_done = True
            return None
        return payload


def iter_sse_data(chunks: Iterable[bytes | str], *, require_done: bool = False
                  ) -> Iterator[str]:
    """``data`` payloads of the events in ``chunks`` (cut anywhere), stopping at ``[DONE]``.
    With ``require_done``, a stream that ends without ``[DONE]`` (the server or the connection
    died mid-answer) raises ``DascError`` after its last payload."""
    decoder = SSEDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
        if decoder.is_done:
            return
    yield from decoder.close()
    if require_done and not decoder.is_done:
        raise DascError(None, _TRUNCATED)


async def aiter_sse_data(chunks: AsyncIterable[bytes | str], *, require_done: bool = False
                         ) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    async for chunk in chunks:
        for payload in decoder.feed(chunk):
            yield payload
        if decoder.is_done:
            return
    for payload in decoder.close():
        yield payload
    if require_done and not decoder.is_done:
        raise DascError(None, _TRUNCATED)


def parse_frame(payload: str) -> dict | None:
    """The JSON object of one payload; None for an empty (keep-alive) payload.
    Raises ``DascError`` for an error frame or a payload that is not a JSON object."""
    if not payload.strip():
        return None
    try:
        frame = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise DascError(None, f"malformed stream frame ({exc.msg}): {payload[:200]!r}") from None
    if not isinstance(frame, dict):
        raise DascError(None, f"stream frame is not a JSON object: {payload[:200]!r}")
    error = error_of(frame)
    if error is not None:
        raise error
    return frame


def error_of(body: dict) -> DascError | None:
    """``{"error": {"message", "code"}}`` / ``{"error": "text"}`` (OpenAI, SGLang) or
    ``{"object": "error", "message"}`` (vLLM) as a ``DascError``; None for other bodies."""
    if "error" in body and body["error"] is not None:
        error = body["error"]
        if isinstance(error, dict):
            code = error.get("code")
            message = error.get("message") or json.dumps(error)
            return DascError(code if isinstance(code, int) else None, str(message))
        return DascError(None, str(error))
    if body.get("object") == "error":
        code = body.get("code")
        return DascError(code if isinstance(code, int) else None, str(body.get("message")))
    return None


def iter_sse_json(chunks: Iterable[bytes | str], *, require_done: bool = False
                  ) -> Iterator[dict]:
    """JSON frames of an OpenAI stream; raises ``DascError`` on an error frame."""
    for payload in iter_sse_data(chunks, require_done=require_done):
        frame = parse_frame(payload)
        if frame is not None:
            yield frame


async def aiter_sse_json(chunks: AsyncIterable[bytes | str], *, require_done: bool = False
                         ) -> AsyncIterator[dict]:
    async for payload in aiter_sse_data(chunks, require_done=require_done):
        frame = parse_frame(payload)
        if frame is not None:
            yield frame
