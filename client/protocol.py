"""The OpenAI wire format, both directions, as pure functions shared by the sync and async
clients: request bodies, whole answers, stream frames, HTTP error bodies."""

from __future__ import annotations

import json
from typing import Any

from client.sse import error_of
from client.types import Completion, DascError, StreamEvent, Usage

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def request_body(key: str, value: Any, max_tokens: int, temperature: float,
                 extra: dict[str, Any], *, model: str | None, stream: bool) -> dict[str, Any]:
    """``key`` is ``prompt`` or ``messages``.  Streams always ask for the usage frame."""
    body: dict[str, Any] = {key: value, "max_tokens": max_tokens, "temperature": temperature}
    if model is not None:
        body["model"] = model
    body.update(extra)
    if stream:
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        body.pop("stream", None)
        body.pop("stream_options", None)
    return body


def _usage(body: dict) -> Usage | None:
    usage = body.get("usage")
    return Usage.from_json(usage) if isinstance(usage, dict) else None


def parse_completion(body: dict, *, is_chat: bool) -> Completion:
    choices = body.get("choices") or []
    if not choices:
        raise DascError(None, f"answer without choices: {json.dumps(body)[:200]}")
    choice = choices[0]
    if is_chat:
        text = (choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return Completion(text=text, finish_reason=choice.get("finish_reason"), usage=_usage(body),
                      token_ids=choice.get("token_ids"),
                      prompt_token_ids=choice.get("prompt_token_ids"), raw=body)


def stream_events(frame: dict, *, is_chat: bool) -> list[StreamEvent]:
    """One event per choice in ``frame``; the frame's usage (if any) goes on the last one, and a
    frame with no choices (the usage frame) becomes a usage-only event, or none without usage."""
    events = []
    for choice in frame.get("choices") or []:
        if is_chat:
            delta = choice.get("delta") or {}
            text, role = delta.get("content") or "", delta.get("role")
        else:
            text, role = choice.get("text") or "", None
        events.append(StreamEvent(text=text, token_ids=choice.get("token_ids"),
                                  finish_reason=choice.get("finish_reason"), role=role,
                                  index=int(choice.get("index") or 0),
                                  prompt_token_ids=choice.get("prompt_token_ids")))
    usage = _usage(frame)
    if usage is not None:
        if events:
            events[-1].usage = usage
        else:
            events.append(StreamEvent(usage=usage))
    return events


def http_error(status: int, reason: str, content: bytes) -> DascError:
    """The message of an OpenAI-style (``{"error": {"message"}}``), vLLM-style or FastAPI-style
    (``{"detail": ...}``) error body; the body's start or the reason phrase otherwise."""
    text = content.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        error = error_of(body)
        if error is not None:
            return DascError(status, error.message)
        if "detail" in body:
            return DascError(status, _detail_message(body["detail"]))
    return DascError(status, text[:500] or reason or "HTTP error")


def _detail_message(detail: Any) -> str:
    if isinstance(detail, list):  # request validation errors: [{"loc": [...], "msg": ...}]
        return "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg')}"
            if isinstance(item, dict) else str(item) for item in detail)
    return str(detail)
