"""Chat messages -> prompt token ids.

With a chat template (``tokenizer.chat_template``), the template renders the conversation with
``add_generation_prompt=True`` and the text is encoded without added special tokens (templates
write their own BOS).  Without one — the built-in tiny models ship none — a plain template is
used, one line per message and an open assistant turn::

    system: You are terse.
    user: Hi
    assistant:

i.e. ``f"{role}: {content}\\n"`` per message followed by ``"assistant:"`` (no trailing space,
so the model chooses the first character of its reply).
"""

from __future__ import annotations

import json
from typing import Any

from dasc_server.chat_request import ChatMessage
from dasc_server.request_errors import RequestError
from dasc_server.tool_calls import tool_format

FALLBACK_ASSISTANT_PREFIX = "assistant:"


def render_fallback(messages: list[ChatMessage]) -> str:
    """The plain template documented above."""
    lines = "".join(f"{m.role}: {m.text}\n" for m in messages)
    return lines + FALLBACK_ASSISTANT_PREFIX


def render_chat(tokenizer: Any, messages: list[ChatMessage],
                tools: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """``tools`` (OpenAI's shape) go to the template, which must have a tool format
    (``dasc_server.tool_calls`` checks); so do the messages' tool calls and tool answers, and
    ``template_kwargs`` (``chat_template_kwargs``, e.g. ``enable_thinking``)."""
    if not getattr(tokenizer, "chat_template", None):
        if any(m.tool_calls for m in messages):
            raise RequestError("this model has no chat template, so it cannot render "
                               "tool_calls", param="messages")
        if template_kwargs:
            raise RequestError("this model has no chat template to take chat_template_kwargs",
                               param="chat_template_kwargs")
        return render_fallback(messages)
    mapping = tool_format(tokenizer) == "xml"
    conversation = [_turn(m, mapping) for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja raises its own types, e.g. for roles out of order
        raise RequestError(f"the chat template rejected the messages: {e}",
                           param="messages") from e


def _turn(m: ChatMessage, arguments_as_mapping: bool) -> dict:
    turn: dict[str, Any] = {"role": m.role, "content": m.text}
    for key in ("tool_call_id", "name"):
        if getattr(m, key, None) is not None:
            turn[key] = getattr(m, key)
    if m.tool_calls is not None:
        turn["tool_calls"] = [_call_with_mapping(c) for c in m.tool_calls] \
            if arguments_as_mapping else m.tool_calls
    return turn


def _call_with_mapping(call: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; templates that write each argument
    (Qwen3.5's XML calls) iterate over a mapping."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage],
                    tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation with an open assistant turn."""
    text = render_chat(tokenizer, messages, tools, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
