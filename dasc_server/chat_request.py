"""``POST /v1/chat/completions``' body: messages (text or text parts, tool turns), logprobs,
tools, and the chat-only fields this server refuses unless neutral, on top of the shared
fields."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dasc_server.generation_request import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
)

# the arguments the server gives the chat template itself
RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "documents", "tokenize",
                            "add_generation_prompt", "continue_final_message", "chat_template")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    # an assistant turn's calls and a tool turn's answer, for templates with a tool format
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Image, video and audio parts get a 400 that says why (the text model is served)."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise ValueError(f"content part {i} has type {kind!r}: this server serves "
                                     "the model's text only (no image, video or audio input)")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``; with
    neither, the rest of the context."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.UNSUPPORTED,
        "functions": (None, []), "function_call": (None, "none", "auto"),
        "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
        "reasoning_effort": (None,), "web_search_options": (None,),
        "add_generation_prompt": (None, True), "continue_final_message": (None, False),
        "chat_template": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # checked against the chat template by ``dasc_server.tool_calls``
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    # extra variables for the model's chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_servers(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server passes them "
                             "to the template itself")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
