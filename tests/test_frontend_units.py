"""Unit tests of the HTTP front end's pure parts: incremental detokeniser with stop strings, the
chat prompt, and the request models.  The byte tokenizer of the tiny models makes ids
predictable: id == UTF-8 byte, 258 = <eos>."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer

from dasc_server.chat import chat_prompt_ids, render_chat, render_fallback
from dasc_server.detokenizer import IncrementalDetokenizer
from dasc_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestError,
    check_model,
    check_prompt,
    validation_error_body,
)
from model_runner.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_bytes

ASSET = Path(__file__).parents[1] / "model_runner" / "assets" / "kimi-linear-tiny"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSET, local_files_only=True)


def run_detok(tok, ids: list[int], stop=(), chunk: int = 1, prompt_ids=()) -> tuple[list[str], str]:
    """Feed ``ids`` ``chunk`` at a time; return the deltas and the flushed tail."""
    detok = IncrementalDetokenizer(tok, stop, prompt_ids)
    deltas = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


# ---- detokeniser: UTF-8 -----------------------------------------------------------------------


def test_multibyte_character_waits_for_its_last_byte(tok):
    detok = IncrementalDetokenizer(tok)
    assert [detok.step([b]) for b in "a€".encode()] == ["a", "", "", "€"]
    assert [detok.step([b]) for b in "🙂".encode()] == ["", "", "", "🙂"]
    assert detok.flush() == ""


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_no_half_characters_in_any_delta(tok, chunk):
    text = "héllo wörld, 日本語 and 🙂🚀 — done"
    deltas, tail = run_detok(tok, encode_bytes(text), chunk=chunk)
    assert "".join(deltas) + tail == text
    assert all("\ufffd" not in d for d in deltas)
    assert tail == ""


def test_special_tokens_are_not_text(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.step([104, BOS_ID, 105]) == "hi"
    assert detok.step([PAD_ID]) == ""
    assert detok.step([EOS_ID]) == ""
    assert detok.flush() == ""


def test_flush_releases_an_unfinished_character(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.step([104]) == "h"
    assert detok.step([0xE2, 0x82]) == ""
    assert detok.flush() == "\ufffd"


def test_prompt_context_does_not_leak_into_output(tok):
    deltas, tail = run_detok(tok, encode_bytes("ok ü"), prompt_ids=encode_bytes("prompt: ä"))
    assert "".join(deltas) + tail == "ok ü"
    # a prompt ending mid-character is dropped as context rather than shifting the output
    deltas, tail = run_detok(tok, encode_bytes("xy"), prompt_ids=[104, 0xE2, 0x82])
    assert "".join(deltas) + tail == "xy"


def test_without_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None, stop=["x"], prompt_ids=[1, 2])
    assert detok.step([104, 105]) == ""
    assert detok.flush() == ""
    assert not detok.stopped


# ---- detokeniser: stop strings ----------------------------------------------------------------


def test_stop_string_cuts_exactly_and_holds_back_partial_matches(tok):
    detok = IncrementalDetokenizer(tok, stop=["wör"])
    out = [detok.step([b]) for b in encode_bytes("héllo wörld")]
    assert "".join(out) == "héllo "
    assert detok.stopped and detok.stop_string == "wör"
    i_w = len(encode_bytes("héllo "))
    assert out[i_w] == ""  # "w" could start "wör": held back
    assert detok.step(encode_bytes("more")) == "" and detok.flush() == ""


def test_held_back_text_is_released_when_the_match_fails(tok):
    detok = IncrementalDetokenizer(tok, stop=["abc"])
    assert detok.step(encode_bytes("xab")) == "x"
    assert detok.step(encode_bytes("x")) == "abx"
    assert detok.step(encode_bytes("a")) == ""
    assert detok.flush() == "a"  # the request ended: a partial stop string is just text
    assert not detok.stopped


def test_first_completed_stop_string_wins(tok):
    deltas, tail = run_detok(tok, encode_bytes("hello world"), stop=["world", "o w"], chunk=20)
    assert "".join(deltas) + tail == "hell"
    detok = IncrementalDetokenizer(tok, stop=["lo", "hé"])
    assert detok.step(encode_bytes("héllo")) == ""
    assert detok.stopped and detok.stop_string == "hé"
    # "0010" starts first but "01" completes first; the grouping of the ids must not matter
    for chunk in (1, 4):
        deltas, tail = run_detok(tok, encode_bytes("0010"), stop=["0010", "01"], chunk=chunk)
        assert "".join(deltas) + tail == "0"


def test_stop_string_inside_one_step_and_with_multibyte_split(tok):
    deltas, _ = run_detok(tok, encode_bytes("abcSTOPdef"), stop=["STOP"], chunk=100)
    assert deltas == ["abc"]
    deltas, _ = run_detok(tok, encode_bytes("naïve"), stop=["ï"], chunk=1)
    assert "".join(deltas) == "na"


def test_stop_string_completed_by_the_last_tokens_is_cut_at_flush(tok):
    detok = IncrementalDetokenizer(tok, stop=["\n\n"])
    assert detok.step(encode_bytes("ok\n")) == "ok"
    assert detok.step(encode_bytes("\n")) == ""
    assert detok.stopped
    detok = IncrementalDetokenizer(tok, stop=["é"])
    assert detok.step([104, 0xC3]) == ""  # a step ending mid-character is held back whole
    assert detok.flush() == "h\ufffd"  # 0xC3 alone is no "é": not a stop


SAFE_TEXT = st.text(st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)),
                    max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=SAFE_TEXT, stops=st.lists(st.text(min_size=1, max_size=4), max_size=3),
       chunk=st.integers(1, 6), data=st.data())
def test_streamed_text_equals_the_text_cut_at_the_first_stop(tok, text, stops, chunk, data):
    if text and data.draw(st.booleans()):  # make a match likely
        i = data.draw(st.integers(0, len(text) - 1))
        stops = [*stops, text[i:i + data.draw(st.integers(1, 3))]]
    # generation stops where the first stop string completes (ties: the longer one)
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    expected = text[:min(hits)[1]] if hits else text
    detok = IncrementalDetokenizer(tok, stops)
    ids = encode_bytes(text)
    emitted = ""
    for i in range(0, len(ids), chunk):
        emitted += detok.step(ids[i:i + chunk])
        assert expected.startswith(emitted)  # nothing is ever taken back
        assert not any(s in emitted for s in stops)
    emitted += detok.flush()
    assert emitted == expected
    assert detok.stopped == bool(hits)


# ---- chat prompt ------------------------------------------------------------------------------


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_fallback_template(tok):
    conversation = msgs(("system", "Be terse."), ("user", "Hi"), ("assistant", "Yo"),
                        ("user", "€?"))
    text = "system: Be terse.\nuser: Hi\nassistant: Yo\nuser: €?\nassistant:"
    assert render_fallback(conversation) == text
    assert tok.chat_template is None
    assert chat_prompt_ids(tok, conversation) == encode_bytes(text)


def test_content_parts_are_joined(tok):
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert render_fallback([message]) == "user: ab\nassistant:"
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "x": 1}]})


def test_chat_template_is_used_when_present():
    tok = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    conversation = msgs(("user", "hi"))
    assert render_chat(tok, conversation) == "<user>hi<assistant>"
    assert chat_prompt_ids(tok, conversation) == encode_bytes("<user>hi<assistant>")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RequestError, match="roles must alternate"):
        render_chat(tok, conversation)


# ---- request models ---------------------------------------------------------------------------


def test_completion_defaults_follow_openai():
    req = CompletionRequest.model_validate({"prompt": "hi", "user": "u", "logprobs": None,
                                            "best_of": 1, "presence_penalty": 0})
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.n) == (16, 1.0, 1.0, 0, 1)
    assert not req.stream and not req.include_usage and req.stop_strings == []
    req = CompletionRequest.model_validate(
        {"prompt": [1, 2], "stop": "x", "stream": True, "stream_options": {"include_usage": True},
         "max_tokens": None, "return_token_ids": True, "ignore_eos": True, "top_k": -1})
    assert req.prompt == [1, 2] and req.stop_strings == ["x"] and req.include_usage
    assert req.requested_max_tokens is None
    req = CompletionRequest.model_validate({"prompt": "a", "stop": ["", "b"]})
    assert req.stop_strings == ["b"]


def test_chat_max_completion_tokens_wins():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body).requested_max_tokens == 16
    req = ChatCompletionRequest.model_validate(
        {**body, "max_tokens": 5, "max_completion_tokens": 7})
    assert req.requested_max_tokens == 7


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "2"]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, None),
    ({"prompt": "x", "logprobs": 1}, None),
    ({"prompt": "x", "frequency_penalty": 0.5}, None),
])
def test_bad_completion_bodies(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    error = validation_error_body(info.value.errors())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
])
def test_bad_chat_bodies(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_json_decode_error_has_no_param():
    errors = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}]
    error = validation_error_body(errors)["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]


def test_check_model():
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(RequestError) as info:
        check_model("gpt-4", "tiny")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.body()["error"]["param"] == "model"


def test_check_prompt():
    limits = {"vocab_size": 264, "max_context_len": 10}
    assert check_prompt([1, 2], 8, **limits) == 8  # exactly fits
    assert check_prompt([1, 2], None, **limits) == 8  # null: the rest of the context
    for ids, max_tokens in [([], 1), ([264], 1), ([-1], 1), ([1, 2], 9), (list(range(10)), None)]:
        with pytest.raises(RequestError) as info:
            check_prompt(ids, max_tokens, **limits)
        assert info.value.status == 400 and info.value.param == "prompt"
