"""``<think>`` split from chat answers (dasc_server/chat.py), without a server: the start
read from the rendered prompt, any split of the text giving the same reasoning and content, tag
prefixes held until decided, and the template check."""

from __future__ import annotations

import random

import pytest
from support.serving import KIMI
from transformers import AutoTokenizer

from dasc_server.chat import (
    ReasoningStream,
    has_reasoning_format,
    prompt_opens_reasoning,
    split_reasoning,
)


def streamed(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(inside), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text,inside,expected", [
    ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.\n", "It is 4.")),
    ("<think>hmm</think>\nYes.", False, ("hmm", "Yes.")),
    ("Yes. <think>not at the start</think>", False, (None, "Yes. <think>not at the start</think>")),
    ("still thinking </thi", True, ("still thinking </thi", "")),  # cut by max_tokens
    ("<thi", False, (None, "<thi")),
    ("</think>", True, (None, "")),
    ("a < b </think>ok", True, ("a < b ", "ok")),
])
def test_whole_answers(text, inside, expected):
    assert split_reasoning(text, inside) == expected


@pytest.mark.parametrize("text,inside", [
    ("Let me see.\n</think>\n\nIt is 4. </think> stays", True),
    ("<think>a</thinking> b</think>\n\nc", False),
    ("no reasoning <think> here", False),
])
def test_any_split_gives_the_same_reasoning_and_content(text, inside):
    reasoning, content = split_reasoning(text, inside)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, min(12, len(text) - 1))))
        assert streamed(text, inside, cuts) == (reasoning or "", content)


def test_the_rendered_prompt_says_where_the_answer_starts():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_only_templates_with_both_tags_reason():
    tok = AutoTokenizer.from_pretrained(KIMI)
    assert not has_reasoning_format(tok)  # no template at all
    tok.chat_template = "{{ messages }}<think>\n\n</think>"
    assert has_reasoning_format(tok)
    tok.chat_template = "{{ messages }}<think>"
    assert not has_reasoning_format(tok)
