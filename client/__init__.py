"""HTTP/SSE client for the dasc front end (OpenAI-compatible), on httpx only."""

from __future__ import annotations

from client.api import DascClient
from client.async_api import AsyncDascClient
from client.sse import SSEDecoder, aiter_sse_data, aiter_sse_json, iter_sse_data, iter_sse_json
from client.types import Completion, DascError, StreamEvent, Usage

__all__ = [
    "AsyncDascClient", "Completion", "DascClient", "DascError", "SSEDecoder", "StreamEvent",
    "Usage", "aiter_sse_data", "aiter_sse_json", "iter_sse_data", "iter_sse_json",
]
