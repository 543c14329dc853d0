"""OpenAI-compatible request models and error bodies of the HTTP front end.

Defaults follow OpenAI's API, not ``SamplingParams``: ``temperature`` defaults to 1.0 (random
sampling; send 0 for greedy), ``max_tokens`` to 16 for both routes.  An explicit
``"max_tokens": null`` means "up to the context limit".  Extensions beyond OpenAI: ``top_k``
(0 or -1 = off), ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids`` (adds ``token_ids``
and ``prompt_token_ids`` to each choice).

Checks that need the server's state (token ids against the vocabulary, the context length, the
model name) live in ``check_prompt`` / ``check_model``; the models check only the body itself.
Every refusal becomes an OpenAI-style body ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

INVALID_REQUEST = "invalid_request_error"


class RequestError(Exception):
    """A request refused before or while it runs; rendered by ``error_body``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = INVALID_REQUEST, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = INVALID_REQUEST,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_body(errors: list[dict]) -> dict:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400 body."""
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":  # its loc is a character position, not a field
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return error_body("; ".join(dict.fromkeys(parts)) or "invalid request", param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by both routes.  Unknown fields are ignored (clients send many)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # distinct seeds, distinct samples
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: bool = False
    # Accepted only at their neutral values: silently ignoring them would change the output.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @model_validator(mode="after")
    def _neutral_unsupported(self) -> _GenerationRequest:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0), ("best_of", 1)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported (only {neutral})")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list; empty strings are dropped (they would match at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[StrictInt]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _no_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs not in (None, 0):
            raise ValueError("only logprobs=0 is supported: the log-probability of each "
                             "generated token, without alternatives")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def check_model(requested: str | None, served: str) -> None:
    """Absent ``model`` means the served one; any other name is a 404 like OpenAI's."""
    if requested is not None and requested != served:
        raise RequestError(f"The model `{requested}` does not exist (this server serves "
                           f"`{served}`).", param="model", status=404, code="model_not_found")


def check_prompt(prompt_ids: list[int], max_tokens: int | None, *, vocab_size: int,
                 max_context_len: int, param: str = "prompt") -> int:
    """Check ids and lengths; return the effective max_tokens (``None``: what is left)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty (after tokenisation)", param=param)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                           param=param)
    prompt_len = len(prompt_ids)
    if max_tokens is None:
        max_tokens = max_context_len - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > max_context_len:
        raise RequestError(
            f"This model's maximum context length is {max_context_len} tokens; the request "
            f"needs {prompt_len + max(max_tokens, 1)} ({prompt_len} in the prompt, "
            f"{max(max_tokens, 1)} to generate).", param=param, code="context_length_exceeded")
    return max_tokens
