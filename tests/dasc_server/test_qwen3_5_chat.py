"""Qwen3.5's chat API through a real dasc-serve and the official ``openai`` client: a random
Qwen3.5 (as Qwen ships it) with a locally built BPE tokenizer and a chat template of Qwen3.5's
shape (``qwen3_5_chat``).  Thinking on returns ``reasoning_content`` and off leaves it out
(``chat_template_kwargs``), streamed and not alike; forced tool calls come back as OpenAI
``tool_calls`` with their schema's types, streamed and not; a conversation carries a call and
its answer back through the template; ``/tokenize`` counts what the chat route prefills and
``/detokenize`` inverts it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.qwen3_5_chat import make_chat_model
from support.serving import running_server

NAME = "qwen3.5-chat"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "celsius": {"type": "boolean"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = make_chat_model(tmp_path_factory.mktemp("qwen3_5") / NAME)
    with running_server("--model", str(folder), "--tp", "2") as server:
        yield server.base_url


@pytest.fixture(scope="module")
def oai(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def chat(oai, stream: bool, **kwargs):
    """(reasoning_content, content, tool_calls, finish_reason), from one answer or a stream."""
    kwargs = {"model": NAME, "messages": ASK, "max_tokens": 24, "temperature": 0.0, **kwargs}
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        m = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return getattr(m, "reasoning_content", None), m.content, calls, choice.finish_reason
    reasoning, content, calls, finish = "", "", [], None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += [(c.function.name, json.loads(c.function.arguments))
                  for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return reasoning or None, content, calls, finish


def test_thinking_on_returns_reasoning_content_streamed_and_not(oai):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = chat(oai, False, extra_body=thinking)
    assert whole[0], "the answer starts inside <think>: its text is reasoning"
    assert whole[:2] == chat(oai, True, extra_body=thinking)[:2]


def test_thinking_off_leaves_reasoning_out(oai):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = chat(oai, False, extra_body=off)
    assert whole[0] is None and whole[1]
    assert chat(oai, True, extra_body=off)[:2] == (None, whole[1])
    assert chat(oai, False)[:2] == whole[:2]  # the template's default is off


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_come_back_typed(oai, stream):
    reasoning, content, calls, finish = chat(oai, stream, tools=[WEATHER, CLOCK],
                                             tool_choice="required", max_tokens=120)
    assert finish == "tool_calls" and reasoning is None and not content
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    for name, args in calls:
        if name == "get_weather":
            assert args["city"] in ("Paris", "Oslo")
            assert isinstance(args.get("celsius", True), bool)
        else:
            assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_once(oai, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    _, _, calls, finish = chat(oai, stream, tools=[WEATHER, CLOCK], tool_choice=choice,
                               max_tokens=60, extra_body={"chat_template_kwargs":
                                                          {"enable_thinking": True}})
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_time"


def test_a_call_and_its_answer_go_back_through_the_template(oai, url):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "celsius": true}'}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    got = oai.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER],
                                      max_tokens=8, temperature=0.0)
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the rendered prompt holds the call's arguments as the template writes them
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<parameter=city>\nOslo\n</parameter>\n<parameter=celsius>\ntrue\n</parameter>" in text
    assert got.usage.prompt_tokens > len(ids)  # the tools' system turn comes on top


def test_tokenize_counts_what_the_chat_route_prefills(oai, url):
    got = oai.chat.completions.create(model=NAME, messages=ASK, max_tokens=2, temperature=0.0)
    tok = httpx.post(f"{url}/tokenize", json={"model": NAME, "messages": ASK}).json()
    assert tok["count"] == len(tok["tokens"]) == got.usage.prompt_tokens
    assert tok["max_model_len"] > 0
    text = httpx.post(f"{url}/tokenize", json={"prompt": "The grass is green.",
                                                "return_token_strs": True}).json()
    back = httpx.post(f"{url}/detokenize", json={"tokens": text["tokens"]}).json()
    assert back["prompt"] == "The grass is green." and len(text["token_strs"]) == text["count"]
    bad = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": ASK})
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_image_parts_are_refused_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=NAME, max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert info.value.body["param"] == "messages" and "image_url" in info.value.body["message"]
