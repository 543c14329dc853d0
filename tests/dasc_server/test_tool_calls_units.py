"""Tool calls in the front end (dasc_server/chat.py), without a server: hermes-style and
XML-style (Qwen3.5) calls split from text delta by delta (any split of the text gives the same
content and calls), malformed calls kept as content, the tool_choice rules and the grammars
that force calls."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest
from support.serving import KIMI
from transformers import AutoTokenizer

from dasc_server.chat import (
    ToolCallStream,
    ToolPlan,
    calls_grammar,
    has_tool_format,
    split_calls,
    tool_format,
    tool_plan,
    xml_calls_grammar,
)
from dasc_server.requests import ChatCompletionRequest, RequestError

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TEXT = f'Let me look. {CALL}\n{CALL.replace("1", "2")}\nbye <tool_ <tool_call>{{broken</tool_call>'
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
    "additionalProperties": False}}}


def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    stream, content, calls = ToolCallStream(), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        got, new = stream.feed(text[a:b])
        content, calls = content + got, calls + new
    return content + stream.finish(), calls


def test_any_split_gives_the_same_content_and_calls():
    whole = streamed(TEXT, [])
    assert [json.loads(c["function"]["arguments"]) for c in whole[1]] == [{"x": 1}, {"x": 2}]
    assert whole[0] == 'Let me look. bye <tool_ <tool_call>{broken</tool_call>'
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(1, 12)))
        content, calls = streamed(TEXT, cuts)
        assert content == whole[0]
        assert [c["function"] for c in calls] == [c["function"] for c in whole[1]]
    assert streamed("a <tool_call>\n{\"name\": \"f\"", [5]) == ('a <tool_call>\n{"name": "f"', [])


def test_split_calls():
    content, calls = split_calls(CALL)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert calls[0]["type"] == "function" and "index" not in calls[0]
    assert split_calls("just text") == ("just text", [])


def test_template_format_and_choice_rules():
    tok = AutoTokenizer.from_pretrained(KIMI)
    assert not has_tool_format(tok)  # the built-in models have no template

    def req(**body):
        return ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **body})

    with pytest.raises(RequestError) as info:
        tool_plan(req(tools=[TOOL]), tok)
    assert info.value.param == "tools"
    assert tool_plan(req(tools=[]), tok) is None
    with pytest.raises(RequestError) as info:
        tool_plan(req(tool_choice="required"), tok)
    assert info.value.param == "tool_choice"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"
    assert tool_plan(req(tools=[TOOL]), tok).grammar == ""  # auto: parsed, not forced
    assert not tool_plan(req(tools=[TOOL], tool_choice="none"), tok).parses_calls
    assert tool_plan(req(tools=[TOOL], tool_choice="required"), tok).grammar


@pytest.mark.parametrize("one_call", [True, False])
def test_the_grammar_forces_well_formed_calls(one_call):
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(KIMI), n_vocab=264)
    grammar = calls_grammar([TOOL], one_call)
    good = CALL.encode()  # spaced as json.dumps (and so chat templates) write calls
    for text, ok in [(good, True), (good + b"\n" + good, not one_call),
                     (good.replace(b'"f"', b'"g"'), False), (good[:-1], False)]:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        consumed = m.consume_tokens(list(text))
        assert (consumed and m.is_accepting() and not m.is_error()) == ok, text


# Qwen3.5's XML style
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"},
        "celsius": {"type": "boolean"}, "note": {"type": "string"}}}}}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\ntrue\n</parameter>\n"
            "<parameter=note>\n 42 \n</parameter>\n</function>\n</tool_call>")


def xml_stream() -> ToolCallStream:
    return ToolPlan([WEATHER], "", True, "xml").stream()


def test_xml_calls_take_their_schema_types_at_any_split():
    text = f"Checking. {XML_CALL}\n{XML_CALL.replace('Paris', 'Oslo')}\ndone"
    content, calls = split_calls(text, xml_stream())
    assert content == "Checking. done"
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert args[0] == {"city": "Paris", "days": 3, "celsius": True, "note": " 42 "}
    assert args[1]["city"] == "Oslo" and calls[0]["function"]["name"] == "get_weather"
    rng = random.Random(1)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 10)))
        stream, got, found = xml_stream(), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            c, new = stream.feed(text[a:b])
            got, found = got + c, found + new
        assert got + stream.finish() == content
        assert [c["function"] for c in found] == [c["function"] for c in calls]


def test_a_malformed_xml_call_stays_content():
    broken = "<tool_call>\n<function=get_weather>\nParis\n</tool_call>"
    assert split_calls(broken, xml_stream()) == (broken, [])


def test_the_template_picks_the_call_style():
    tok = AutoTokenizer.from_pretrained(KIMI)
    tok.chat_template = "{{ messages }}<tool_call><function=x>"
    assert tool_format(tok) == "xml"
    tok.chat_template = "{{ messages }}<tool_call>"
    assert tool_format(tok) == "hermes"
    tok.chat_template = None
    assert tool_format(tok) is None


@pytest.mark.parametrize("one_call", [True, False])
def test_the_xml_grammar_forces_well_formed_calls(one_call):
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(KIMI), n_vocab=264)
    grammar = xml_calls_grammar([WEATHER], one_call)
    good = XML_CALL.encode()
    minimal = (b"<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
               b"</function>\n</tool_call>")
    for text, ok in [(good, True), (minimal, True), (good + b"\n" + minimal, not one_call),
                     (good.replace(b"Paris", b"Rome"), False),  # not in the enum
                     (good.replace(b"\n3\n", b"\nthree\n"), False),  # not an integer
                     (minimal.replace(b"<parameter=city>\nOslo\n</parameter>\n", b""), False),
                     (good[:-1], False)]:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        consumed = m.consume_tokens(list(text))
        assert (consumed and m.is_accepting() and not m.is_error()) == ok, text
