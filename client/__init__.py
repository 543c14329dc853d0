"""HTTP/SSE client for the dasc front end (OpenAI-compatible), on httpx only.

The names below are imported on first use, so that tools needing only ``client.cli_help``
(every ``--help``) do not pay for importing httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "DascClient": "client.api", "AsyncDascClient": "client.async_api",
    "SSEDecoder": "client.sse", "aiter_sse_data": "client.sse", "aiter_sse_json": "client.sse",
    "iter_sse_data": "client.sse", "iter_sse_json": "client.sse",
    "Completion": "client.types", "DascError": "client.types", "StreamEvent": "client.types",
    "Usage": "client.types",
}
__all__ = [
    "AsyncDascClient", "Completion", "DascClient", "DascError", "SSEDecoder", "StreamEvent",
    "Usage", "aiter_sse_data", "aiter_sse_json", "iter_sse_data", "iter_sse_json",
]

if TYPE_CHECKING:
    from client.api import DascClient
    from client.async_api import AsyncDascClient
    from client.sse import SSEDecoder, aiter_sse_data, aiter_sse_json, iter_sse_data, iter_sse_json
    from client.types import Completion, DascError, StreamEvent, Usage


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
