"""httpx plumbing shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from client.protocol import http_error
from client.types import DascError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def client_options(base_url: str, api_key: str | None, timeout: float | httpx.Timeout | None,
                   max_connections: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # The pool must not be smaller than the caller's concurrency, or it throttles the load.
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    # trust_env=False: an HTTP(S)_PROXY in the environment must not reroute a local server.
    return {"base_url": base_url.rstrip("/"), "headers": headers, "timeout": timeout,
            "limits": limits, "trust_env": False}


@contextmanager
def transport_errors(url: str) -> Iterator[None]:
    """httpx's connection, timeout and protocol errors as ``DascError`` naming ``url``."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise DascError(None, f"cannot connect to {url} ({exc})") from exc
    except httpx.TimeoutException as exc:
        raise DascError(None, f"timed out on {url} ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise DascError(None, f"{url}: {type(exc).__name__}: {exc}") from exc


def check(response: httpx.Response) -> httpx.Response:
    """``response`` if successful; its error as ``DascError`` otherwise (body must be read)."""
    if response.is_error:
        raise http_error(response.status_code, response.reason_phrase, response.content)
    return response


def json_body(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise DascError(response.status_code,
                        f"expected a JSON object from {response.url}: {response.text[:200]!r}")
    return body
