"""Chat: the model's chat template over the messages, the reasoning parser that splits
thinking from the answer, and tool calls (the parser of the model's tool-call markup, the
grammar that forces a named or required call)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from dasc_server.requests import ChatCompletionRequest, ChatMessage, RequestError, checked

# Chat messages -> prompt token ids.
#
# With a chat template (``tokenizer.chat_template``), the template renders the conversation with
# ``add_generation_prompt=True`` and the text is encoded without added special tokens (templates
# write their own BOS).  Without one — the built-in tiny models ship none — a plain template is
# used, one line per message and an open assistant turn::
#
#     system: You are terse.
#     user: Hi
#     assistant:
#
# i.e. ``f"{role}: {content}\n"`` per message followed by ``"assistant:"`` (no trailing space,
# so the model chooses the first character of its reply).

FALLBACK_ASSISTANT_PREFIX = "assistant:"


def render_fallback(messages: list[ChatMessage]) -> str:
    """The plain template documented above."""
    lines = "".join(f"{m.role}: {m.text}\n" for m in messages)
    return lines + FALLBACK_ASSISTANT_PREFIX


def render_chat(tokenizer: Any, messages: list[ChatMessage],
                tools: list[dict] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """``tools`` (OpenAI's shape) go to the template, which must have a tool format
    (``tool_plan`` checks); so do the messages' tool calls and tool answers, and
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


# ``<think>…</think>`` split out of a chat answer as ``reasoning_content`` (vLLM's
# ``--reasoning-parser qwen3``), for models whose chat template writes those tags.
#
# Where the reasoning starts is read from the rendered prompt: a template that opens the
# assistant turn with ``<think>\n`` (Qwen3.5 with thinking on) leaves the model inside it, so
# the answer is reasoning up to ``</think>``; one that closes it in the prompt
# (``<think>\n\n</think>\n\n``, thinking off) leaves the model in the content.  An answer that
# itself begins with ``<think>`` enters it too.  Newlines right after ``</think>`` are dropped, as
# the template drops them when it renders the turn back.  Text that may be the start of a tag is
# held until it is decided, so a stream splits exactly as the whole answer does.

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def has_reasoning_format(tokenizer: Any | None) -> bool:
    template = template_text(tokenizer)
    return THINK_OPEN in template and THINK_CLOSE in template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Does the rendered prompt leave the assistant inside an open ``<think>``?"""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


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
                end = self.pending.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_suffix(self.pending, THINK_CLOSE)
                    reasoning += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning += self.pending[:end]
                self.pending = self.pending[end + len(THINK_CLOSE):]
                self.inside, self.at_start, self.after_close = False, False, True
                continue
            if self.after_close:
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.after_close = False
            if self.at_start:
                if THINK_OPEN.startswith(self.pending):  # could still become <think>
                    break
                self.at_start = False
                if self.pending.startswith(THINK_OPEN):
                    self.pending, self.inside = self.pending[len(THINK_OPEN):], True
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


# Chat ``tools`` and ``tool_choice`` for models whose chat template writes calls in one of two
# styles, told apart by the template: hermes (JSON, Qwen3-Next's)::
#
#     <tool_call>
#     {"name": "get_weather", "arguments": {"city": "Paris"}}
#     </tool_call>
#
# or XML (Qwen3.5's, vLLM's ``qwen3_coder`` parser), each parameter's value as text, converted
# to the type its schema gives (numbers, booleans, JSON objects and arrays; strings as written)::
#
#     <tool_call>
#     <function=get_weather>
#     <parameter=city>
#     Paris
#     </parameter>
#     </function>
#     </tool_call>
#
# The template renders the tools into the prompt; ``tool_choice``
# decides the output: ``"none"`` leaves it alone (text only), ``"auto"`` (the default with tools)
# lets the model choose and parses the calls it writes, ``"required"`` and a named function force
# calls through a grammar whose JSON is each tool's ``{"name", "arguments"}`` schema (one call
# when ``parallel_tool_calls`` is false; in the XML style a string parameter's value cannot
# contain ``<``).  Calls come back as OpenAI ``tool_calls`` (arguments a
# JSON string) with ``finish_reason: "tool_calls"``; text outside the calls stays ``content``.
#
# A template without either format (the built-in tiny models have no template at all) cannot
# carry tools: a request with tools gets a 400 naming ``tools``, never a silent drop.

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# calls spaced as templates write past ones (jinja's tojson is json.dumps: ", " and ": ")
CALL_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


FUNCTION = "<function="  # the XML style's mark in a template


def template_text(tokenizer: Any | None) -> str:
    """The chat template's source ("" without one; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def tool_format(tokenizer: Any | None) -> str | None:
    """"xml", "hermes" or None: the call style the chat template writes."""
    template = template_text(tokenizer)
    if CALL_OPEN not in template:
        return None
    return "xml" if FUNCTION in template else "hermes"


def has_tool_format(tokenizer: Any | None) -> bool:
    return tool_format(tokenizer) is not None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict]  # as the request sent them, for the template
    grammar: str  # "" unless the calls are forced
    parses_calls: bool  # False for tool_choice "none"
    style: str = "hermes"  # or "xml"

    def stream(self) -> ToolCallStream:
        """A parser of this plan's calls."""
        if self.style == "xml":
            return ToolCallStream(parse=lambda body: xml_call(body, self.tools))
        return ToolCallStream()


def tool_plan(req: ChatCompletionRequest, tokenizer: Any | None) -> ToolPlan | None:
    """What the request's tools ask for; None when it has none."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    names = _checked_tools(tools)
    style = tool_format(tokenizer)
    if style is None:
        raise RequestError("this model's chat template has no tool-call format "
                           f"({CALL_OPEN}...{CALL_CLOSE}), so it cannot take tools", param="tools")
    grammar = xml_calls_grammar if style == "xml" else calls_grammar
    one_call = req.parallel_tool_calls is False
    if choice in (None, "auto"):
        if one_call:
            raise RequestError("parallel_tool_calls false needs tool_choice required or a "
                               "named function", param="parallel_tool_calls")
        return ToolPlan(tools, "", True, style)
    if choice == "none":
        return ToolPlan(tools, "", False, style)
    if choice == "required":
        return ToolPlan(tools, grammar(tools, one_call), True, style)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', param="tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice")
    return ToolPlan(tools, grammar([tools[names.index(name)]], True), True, style)


def _checked_tools(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("parameters", {}), dict)):
            raise RequestError('each tool must be {"type": "function", "function": {"name": '
                               '..., "parameters": {...}}}', param="tools")
        names.append(function["name"])
    return names


def calls_grammar(tools: list[dict], one_call: bool) -> str:
    """Calls of these tools, hermes-style, one or more (``one_call``: exactly one)."""
    options = [{"type": "object", "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters")
                               or {"type": "object"}}} for t in tools]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}),
              "x-guidance": CALL_STYLE}
    repeat = "" if one_call else ' ("\\n" call)*'
    lark = (f"start: call{repeat}\n"
            f'call: "{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"\n')
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def xml_calls_grammar(tools: list[dict], one_call: bool) -> str:
    """XML-style calls of these tools (``one_call``: exactly one): the required parameters in
    the schema's order, then the optional ones, each optional; a value is its schema's JSON
    for a non-string, one of its ``enum`` for a string with one, else text without ``<``."""
    nl, rules, names = "\n", [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = fn.get("parameters") or {}
        props, required = schema.get("properties") or {}, set(schema.get("required") or [])
        order = [p for p in props if p in required] + [p for p in props if p not in required]
        parts = []
        for j, param in enumerate(order):
            head, tail = json.dumps(f"<parameter={param}>{nl}"), json.dumps(f"</parameter>{nl}")
            rules.append(f"p{i}_{j}: {head} {_xml_value(props[param])} {tail}")
            parts.append(f"p{i}_{j}" if param in required else f"p{i}_{j}?")
        head = json.dumps(f"{CALL_OPEN}{nl}{FUNCTION}{fn['name']}>{nl}")
        tail = json.dumps(f"</function>{nl}{CALL_CLOSE}")
        rules.append(f"call{i}: {head} {' '.join(parts)} {tail}")
        names.append(f"call{i}")
    repeat = "" if one_call else ' ("\\n" call)*'
    lark = f"start: call{repeat}{nl}call: {' | '.join(names)}{nl}" + nl.join(rules) + nl
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def _xml_value(schema: Any) -> str:
    """A parameter's value and the newline after it.  Free text takes the newline into its
    own lexeme (the lexer does not hand back a newline it has taken)."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ') "\\n"'
        return "/[^<]*\\n/"
    return f'%json {json.dumps({**schema, "x-guidance": CALL_STYLE})} "\\n"'


def xml_call(body: str, tools: list[dict]) -> dict | None:
    """One XML-style call's body (between the tags) -> an OpenAI call, or None if malformed."""
    m = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", body, re.DOTALL)
    if m is None:
        return None
    name, inner = m[1].strip(), m[2]
    schemas = next((t["function"].get("parameters") or {} for t in tools
                    if t["function"]["name"] == name), {})
    props = schemas.get("properties") or {}
    arguments, rest = {}, inner
    for p in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", inner, re.DOTALL):
        arguments[p[1].strip()] = _typed(p[2], props.get(p[1].strip()))
        rest = rest.replace(p[0], "", 1)
    if rest.strip():
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _typed(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type; as written when it does not parse."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or kind is None and not text.strip():
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if kind is None or kind in ("integer", "number", "boolean", "object", "array", "null"):
        return value
    return text


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    arguments = obj.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments if isinstance(
                arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


@dataclass(slots=True)
class ToolCallStream:
    """Splits a choice's text, delta by delta, into content and complete tool calls.  Text
    that may begin a call (a prefix of ``<tool_call>``) is held until it is decided; a call
    whose JSON does not parse stays content, as written."""

    pending: str = ""
    in_call: bool = False
    after_call: bool = False  # newlines that separate calls are not content
    calls: list[dict] = field(default_factory=list)
    parse: Callable[[str], dict | None] = field(default=lambda body: _call(body.strip()))

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """-> (content to send now, calls completed now)."""
        self.pending += text
        content, new = "", []
        while True:
            if not self.in_call:
                if self.after_call:
                    self.pending = self.pending.lstrip("\n")
                    self.after_call = not self.pending
                at = self.pending.find(CALL_OPEN)
                if at < 0:
                    keep = partial_suffix(self.pending, CALL_OPEN)
                    content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return content, new
                content += self.pending[:at]
                self.pending, self.in_call = self.pending[at + len(CALL_OPEN):], True
            end = self.pending.find(CALL_CLOSE)
            if end < 0:
                return content, new
            call = self.parse(self.pending[:end])
            if call is None:
                content += CALL_OPEN + self.pending[: end + len(CALL_CLOSE)]
            else:
                call["index"] = len(self.calls)
                self.calls.append(call)
                new.append(call)
            self.pending, self.in_call = self.pending[end + len(CALL_CLOSE):], False
            self.after_call = call is not None

    def finish(self) -> str:
        """The held text, as content (an unfinished call is content too)."""
        rest = (CALL_OPEN if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return rest


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(text: str, stream: ToolCallStream | None = None
                ) -> tuple[str | None, list[dict]]:
    """A whole output -> (content or None, tool calls), parsed by a fresh ``stream``."""
    stream = stream or ToolCallStream()
    content, calls = stream.feed(text)
    content = (content + stream.finish()).strip()
    return content or None, [{k: v for k, v in c.items() if k != "index"} for c in calls]
