"""What the client hands back: usage, whole completions, stream events, errors."""

from __future__ import annotations

from dataclasses import dataclass, field


class DascError(Exception):
    """A failed request: HTTP error status (None when there was no HTTP status, e.g. connection
    refused, or an error frame inside a 200 stream without a code) and the server's message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.status = status
        self.message = message


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # None when the server does not report ``prompt_tokens_details.cached_tokens``: "not
    # reported" must stay distinguishable from "nothing was cached".
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, usage: dict) -> Usage:
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                   completion_tokens=int(usage.get("completion_tokens") or 0),
                   cached_tokens=int(cached) if cached is not None else None)


@dataclass(slots=True)
class Completion:
    """The first choice of a non-streaming ``/v1/completions`` or ``/v1/chat/completions``
    answer.  ``token_ids`` / ``prompt_token_ids`` are set when the server returns them
    (``return_token_ids=True``); ``raw`` is the whole response body."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    raw: dict = field(default_factory=dict, repr=False)


@dataclass(slots=True)
class StreamEvent:
    """One choice of one stream frame, or the final usage-only frame (empty ``text``, no
    ``finish_reason``, ``usage`` set).  A chat stream's first frame may carry only ``role``.
    For TTFT, the first event with non-empty ``text`` is the first token (SGLang's rule)."""

    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    role: str | None = None
    index: int = 0
    prompt_token_ids: list[int] | None = None  # first frame, with return_token_ids=True
