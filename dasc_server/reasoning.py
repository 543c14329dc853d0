"""``<think>…</think>`` split out of a chat answer as ``reasoning_content`` (vLLM's
``--reasoning-parser qwen3``), for models whose chat template writes those tags.

Where the reasoning starts is read from the rendered prompt: a template that opens the
assistant turn with ``<think>\\n`` (Qwen3.5 with thinking on) leaves the model inside it, so
the answer is reasoning up to ``</think>``; one that closes it in the prompt
(``<think>\\n\\n</think>\\n\\n``, thinking off) leaves the model in the content.  An answer that
itself begins with ``<think>`` enters it too.  Newlines right after ``</think>`` are dropped, as
the template drops them when it renders the turn back.  Text that may be the start of a tag is
held until it is decided, so a stream splits exactly as the whole answer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dasc_server.tool_calls import partial_suffix, template_text

OPEN, CLOSE = "<think>", "</think>"


def has_reasoning_format(tokenizer: Any | None) -> bool:
    template = template_text(tokenizer)
    return OPEN in template and CLOSE in template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Does the rendered prompt leave the assistant inside an open ``<think>``?"""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass(slots=True)
class ReasoningStream:
    """Splits a choice's text, delta by delta, into (reasoning, content)."""

    inside: bool  # in the reasoning now
    at_start: bool = True  # nothing decided yet: the answer may still open with <think>
    after_close: bool = False  # newlines after </think> are dropped
    pending: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    keep = partial_suffix(self.pending, CLOSE)
                    reasoning += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning += self.pending[:end]
                self.pending = self.pending[end + len(CLOSE):]
                self.inside, self.at_start, self.after_close = False, False, True
                continue
            if self.after_close:
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_close = False
            if self.at_start:
                if OPEN.startswith(self.pending):  # could still become <think>
                    break
                self.at_start = False
                if self.pending.startswith(OPEN):
                    self.pending, self.inside = self.pending[len(OPEN):], True
                    continue
            content += self.pending
            self.pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text: reasoning if inside, else content."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole answer -> (reasoning or None, content)."""
    stream = ReasoningStream(inside)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, content + more_content

