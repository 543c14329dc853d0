"""Structured output against a real dasc-serve with the official ``openai`` client:
``response_format`` json_schema (``chat.completions.parse`` with a pydantic model) and
json_object on both routes, streamed and not, a cut at ``max_tokens`` reported as "length",
schemas the grammar cannot enforce refused with a 400.

The server runs the built-in tiny Kimi-Linear model (byte tokenizer) from a copy of its folder
whose tokenizer carries a hermes-style chat template, so the tool-call tests
(``test_tool_calls.py`` shares the fixture) have a template with a tool format.
"""

from __future__ import annotations

import json
import shutil
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from serving import KIMI, running_server

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
