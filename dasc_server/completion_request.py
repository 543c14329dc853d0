"""``POST /v1/completions``' body: one prompt (text or token ids) or a batch of them, with
echo, logprobs and ``suffix`` (refused unless empty) on top of the shared fields."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, StrictBool, StrictInt, field_validator

from dasc_server.generation_request import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    Prompt,
)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **GenerationRequest.UNSUPPORTED, "suffix": (None, "")}

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo (checked in ``app``)
    echo: StrictBool | None = False  # the prompt before the completion (and its logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # top-k per token
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: Any) -> Any:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(p, str | list) and not p for p in prompt):
            raise ValueError("no prompt of a batch may be empty")
        return prompt

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def prompts(self) -> list[Prompt]:
        """The batch; a lone string or token-id list is a batch of one."""
        if isinstance(self.prompt, str) or not isinstance(self.prompt[0], str | list):
            return [self.prompt]
        return list(self.prompt)
