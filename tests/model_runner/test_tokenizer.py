"""The byte tokenizer loads offline through AutoTokenizer and maps text to its UTF-8 bytes."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from model_runner.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    MODEL_VOCAB_SIZE,
    NUM_TOKENS,
    PAD_ID,
    decode_bytes,
    encode_bytes,
    write_byte_tokenizer,
)

TEXTS = [
    "",
    "a",
    "Hello, world.",
    "  leading and trailing spaces  ",
    "spaces before punctuation , . ? ! don't 's n't",  # clean-up would rewrite these
    "tabs\tand\nnewlines\r\n\n",
    "kqzvb: 48213. value of kqzvb:",
    "héllo wörld ñ ß",
    "日本語のテキスト",
    "emoji 🙂🚀 and \u200b zero width",
    "<pad> <bos> <eos> look like specials but are text",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    model_dir = write_byte_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_files_written(tmp_path):
    write_byte_tokenizer(tmp_path)
    names = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert names <= {p.name for p in tmp_path.iterdir()}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False


def test_special_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert len(tok) == NUM_TOKENS <= MODEL_VOCAB_SIZE
    assert MODEL_VOCAB_SIZE % 8 == 0


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_utf8_bytes_and_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) == encode_bytes(text)
    assert tok(text)["input_ids"] == ids  # no BOS / EOS added by the call path either
    assert tok.decode(ids) == text
    assert decode_bytes(ids) == text


def test_specials_in_text_are_bytes_not_specials(tok):
    assert tok.encode("<eos>") == list(b"<eos>")


def test_every_byte_value_is_its_own_id(tok):
    chars = [chr(c) for c in range(0x800)]  # ASCII, every 2-byte lead and continuation byte
    chars += [chr(0x800)] + [chr(x << 12) for x in range(1, 16)]  # 3-byte leads E0..EF
    chars += [chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000)]  # F0..F4
    text = "".join(chars)
    data = text.encode("utf-8")
    never_utf8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert set(data) == set(range(256)) - never_utf8
    assert tok.encode(text) == list(data)
    assert tok.decode(list(data)) == text
    tokens = tok.convert_ids_to_tokens(list(range(256)))
    assert len(set(tokens)) == 256
    assert tok.convert_tokens_to_ids(tokens) == list(range(256))


def test_random_unicode_round_trip(tok):
    rng = random.Random(0)
    for _ in range(50):
        points = [rng.choice((rng.randrange(32, 127), rng.randrange(0xA0, 0xD800),
                              rng.randrange(0xE000, 0x110000))) for _ in range(rng.randrange(40))]
        text = "".join(map(chr, points))
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_decode_skips_specials_on_request(tok):
    ids = [BOS_ID, *encode_bytes("ok"), EOS_ID, PAD_ID]
    assert tok.decode(ids, skip_special_tokens=True) == "ok"
    assert tok.decode(ids) == "<bos>ok<eos><pad>"
    assert decode_bytes(ids) == "ok"
