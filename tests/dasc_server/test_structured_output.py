"""Structured output and tool calls against a real dasc-serve with the official ``openai``
client: ``response_format`` json_schema (``chat.completions.parse`` with a pydantic model) and
json_object on both routes, streamed and not, a cut at ``max_tokens`` reported as "length",
schemas the grammar cannot enforce refused with a 400; ``tools`` with ``tool_choice`` required,
a named function, ``parallel_tool_calls`` false and auto, streamed and not, and a conversation
that carries calls and their results back.

The server runs the built-in tiny Kimi-Linear model (byte tokenizer) from a copy of its folder
whose tokenizer carries a hermes-style chat template (the shipped one has no template, so no
tool format: ``test_server_api`` checks its 400).
"""

from __future__ import annotations

import json
import shutil
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from support.serving import KIMI, running_server

MODEL_NAME = "tiny-tools"
HERMES_TEMPLATE = (
    "{%- if tools %}system: You may call these tools: {% for t in tools %}{{ t | tojson }} "
    "{% endfor %}Answer a call as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n"
    "</tool_call>\n{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments }}}\n</tool_call>{% endfor %}\n{% endfor %}"
    "assistant:")


class Weather(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    tag: str = Field(max_length=6)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The tiny model's folder, its tokenizer given a chat template with a tool format."""
    folder = tmp_path_factory.mktemp("model") / MODEL_NAME
    shutil.copytree(KIMI, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def url(tool_model):
    with running_server("--model", str(tool_model), "--max-total-tokens", "2048") as s:
        yield s.base_url


@pytest.fixture(scope="module")
def oai(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


# as OpenAI's strict mode asks: no properties beyond the schema's
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "weather", "strict": True,
    "schema": {**Weather.model_json_schema(), "additionalProperties": False}}}


def test_chat_parse_with_a_pydantic_model(oai):
    for seed in (0, 1):
        got = oai.chat.completions.parse(
            model=MODEL_NAME, messages=[{"role": "user", "content": "The weather, as JSON."}],
            response_format=Weather, max_tokens=120, temperature=1.0, seed=seed)
        choice = got.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)
        assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_json_schema_streamed_and_not(oai, temperature):
    kwargs = dict(model=MODEL_NAME, prompt="The grass is green. Report:", max_tokens=120,
                  temperature=temperature, seed=5, extra_body={"response_format": SCHEMA_FORMAT})
    whole = oai.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    Weather.model_validate_json(whole.text)
    chunks = list(oai.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_on_both_routes(oai):
    fmt = {"type": "json_object"}
    text = oai.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=200, temperature=1.0, seed=1,
        extra_body={"response_format": fmt}).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Reply in JSON."}],
        max_tokens=200, temperature=1.0, seed=1, response_format=fmt).choices[0]
    assert chat.finish_reason == "stop" and isinstance(json.loads(chat.message.content), dict)


def test_a_cut_at_max_tokens_is_length_and_a_json_prefix(oai):
    got = oai.completions.create(model=MODEL_NAME, prompt="Report:", max_tokens=12,
                                 temperature=0.0,
                                 extra_body={"response_format": SCHEMA_FORMAT}).choices[0]
    assert got.finish_reason == "length" and got.text.startswith('{"color":"')


def test_n_samples_are_each_valid(oai):
    got = oai.completions.create(model=MODEL_NAME, prompt=["Report:", "Now:"], n=2,
                                 max_tokens=120, temperature=1.5, seed=3,
                                 extra_body={"response_format": SCHEMA_FORMAT})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        Weather.model_validate_json(choice.text)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "odd"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    {"type": "grammar"},
    "json",
])
def test_unenforceable_formats_are_400(oai, fmt):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                               extra_body={"response_format": fmt})
    assert info.value.body["param"] == "response_format"


def test_ignore_eos_cannot_end_the_json(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                               extra_body={"response_format": {"type": "json_object"},
                                           "ignore_eos": True})
    assert info.value.body["param"] == "ignore_eos"


# ---- tools -------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed_calls(oai, **kwargs) -> tuple[list[tuple[str, dict]], str | None, str]:
    """Accumulate a stream's tool-call deltas as OpenAI's clients do: by index, arguments
    concatenated."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            got = calls.setdefault(c.index, {"name": "", "arguments": "", "id": c.id})
            got["name"] += c.function.name or ""
            got["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return ([(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            finish, content)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_calls_streamed_and_not(oai, choice):
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                  max_tokens=140, temperature=1.0, seed=2)
    got = oai.chat.completions.create(**kwargs).choices[0]
    # one call (named), or as many as the model writes (required: it may go on to max_tokens,
    # a cut call then stays content)
    assert got.finish_reason == "tool_calls" or (choice == "required"
                                                 and got.finish_reason == "length")
    calls = calls_of(got.message)
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    for name, args in calls:
        if name == "get_time":
            assert args["zone"] in ("utc", "cet")
        else:
            assert args["unit"] in ("c", "f") and len(args["city"]) <= 8
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in got.message.tool_calls)
    assert streamed_calls(oai, **kwargs)[:2] == (calls, got.finish_reason)


def test_parallel_tool_calls_false_makes_one_call(oai):
    for seed in range(2):
        got = oai.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, max_tokens=140, temperature=1.5, seed=seed).choices[0]
        assert got.finish_reason == "tool_calls" and len(got.message.tool_calls) == 1


def test_auto_and_none_answer_in_text_when_the_model_writes_text(oai):
    for choice in ("auto", "none"):
        got = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER],
                                          tool_choice=choice, max_tokens=20,
                                          temperature=0.0).choices[0]
        assert got.finish_reason in ("stop", "length") and not got.message.tool_calls
        assert got.message.content


def test_a_conversation_carries_calls_and_results_back(oai):
    first = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER],
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=300, temperature=0.0).choices[0].message
    call = first.tool_calls[0]
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 c"}]
    again = oai.chat.completions.create(model=MODEL_NAME, messages=turns, tools=[WEATHER],
                                        max_tokens=8, temperature=0.0)
    assert again.usage.prompt_tokens > 0 and again.choices[0].finish_reason in (
        "stop", "length", "tool_calls")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False},
     "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400(url, extra, param):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_books_balance_after_structured_and_tool_requests(url):
    """Every request above ran to its end or its cut: nothing left running, every KV row and
    checkpoint slot free or cached, the cache's integrity check passes."""
    s = httpx.get(f"{url}/v1/stats", timeout=30).json()
    assert s["integrity"] == "ok" and s["num_running"] == s["num_waiting"] == 0
    assert s["kv_rows_free"] + s["kv_rows_cached"] == s["kv_rows_total"]
    assert s["checkpoint_slots_free"] + s["checkpoint_slots_cached"] == \
        s["checkpoint_slots_total"]
