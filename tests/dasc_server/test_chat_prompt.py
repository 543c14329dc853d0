"""The chat prompt (dasc_server/chat.py): the fallback template, content parts, and a model's
own chat template when it has one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from support.frontend_helpers import ASSET, tiny_tokenizer
from transformers import AutoTokenizer

from dasc_server.chat import chat_prompt_ids, render_chat, render_fallback
from dasc_server.requests import ChatMessage, RequestError
from model_runner.byte_tokenizer import encode_bytes


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


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
