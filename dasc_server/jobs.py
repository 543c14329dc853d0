"""One HTTP generation request as the response builders see it: its ``Job`` and ``Choice``s
(one engine request per choice: ``n`` samples of each prompt of a batch), a choice's text
``Delta``s, and what a JSON answer ``Collected`` of a choice."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dasc_server.detokenizer import TextOffsets
from dasc_server.metrics import Metrics
from dasc_server.reasoning import ReasoningStream
from dasc_server.tool_calls import ToolCallStream
from scheduler.wire.messages import SamplingParams


@dataclass(slots=True)
class Choice:
    """One sample of one prompt: its own engine request.  ``index`` is OpenAI's,
    prompt-major: ``prompt_index * n + sample_index``."""

    index: int
    prompt_index: int
    sample_index: int
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    offsets: TextOffsets = field(default_factory=TextOffsets)  # completions' text_offset
    tool_calls: ToolCallStream | None = None  # chat with tools: calls parsed from the text
    reasoning: ReasoningStream | None = None  # chat, reasoning template: <think> split out
    echo_only: bool = False  # echo with max_tokens 0: the engine's one token is dropped


@dataclass(slots=True)
class Job:
    """One validated HTTP request: its choices and what they share."""

    is_chat: bool
    id: str
    model: str
    choices: list[Choice]
    stop: list[str]
    return_token_ids: bool
    include_usage: bool
    logprobs: bool  # completions' ``logprobs`` set, or chat's ``logprobs: true``
    created: int
    metrics: Metrics
    arrived: float  # perf_counter() when the request was accepted
    share_prompts: bool = True  # hold samples j > 0 until sample 0 has cached the prompt
    num_returned: int = 1  # choices per prompt in the answer (n); fewer than drawn: best_of
    primed: dict[int, asyncio.Event] = field(default_factory=dict)  # by prompt index
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion

    def envelope(self, chunk: bool) -> dict:
        if self.is_chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        prefix = "chatcmpl-" if self.is_chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created,
                "model": self.model}

    def usage(self) -> dict:
        """As OpenAI counts: each prompt once (with its first sample's cache hit), every
        choice's completion tokens."""
        firsts = [c for c in self.choices if c.sample_index == 0]
        num_prompt = sum(len(c.prompt_ids) for c in firsts)
        num_completion = sum(c.num_completion_tokens for c in self.choices)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # set on the last delta only
    top_ids: list[list[int]] = field(default_factory=list)  # as TokenOut's
    top_logprobs: list[list[float]] = field(default_factory=list)
    # echo, first delta only: the prompt's ids and (with logprobs) TokenOut's prompt_* fields
    echo_ids: list[int] = field(default_factory=list)
    echo_logprobs: list[float] = field(default_factory=list)
    echo_top_ids: list[list[int]] = field(default_factory=list)
    echo_top_logprobs: list[list[float]] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # chat: calls completed here
    reasoning: str = ""  # chat: reasoning_content of this delta


@dataclass(slots=True)
class Collected:
    """A choice's deltas joined, for the JSON answer."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    echo_ids: list[int] = field(default_factory=list)  # as Delta's
    echo_logprobs: list[float] = field(default_factory=list)
    echo_top_ids: list[list[int]] = field(default_factory=list)
    echo_top_logprobs: list[list[float]] = field(default_factory=list)
