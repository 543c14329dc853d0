"""Byte-level tokenizer for the tiny test models, in Hugging Face's fast-tokenizer format.

Token ids 0..255 are the raw UTF-8 bytes (id == byte value), so ids are predictable without a
tokenizer: ``list(text.encode())`` is the encoding.  Three specials follow: ``<pad>`` = 256,
``<bos>`` = 257, ``<eos>`` = 258.  Nothing is added automatically: ``encode`` never prepends
``<bos>`` nor appends ``<eos>`` (the tiny models are trained without a BOS), and decoding does
no whitespace clean-up, so ``decode(encode(text)) == text`` for every valid UTF-8 string.
Special tokens are never parsed out of text (``split_special_tokens``): the string "<eos>" is
five byte tokens, so the ids of any text are exactly its bytes; specials enter only as ids.

``write_byte_tokenizer(model_dir)`` writes tokenizer.json, tokenizer_config.json and
special_tokens_map.json; ``transformers.AutoTokenizer.from_pretrained(model_dir)`` then loads a
``PreTrainedTokenizerFast`` offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

NUM_BYTES = 256
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
NUM_TOKENS = NUM_BYTES + len(SPECIAL_TOKENS)  # 259
MODEL_VOCAB_SIZE = 264  # NUM_TOKENS padded to a multiple of 8; ids 259..263 are never produced
MODEL_MAX_LENGTH = 8192


def encode_bytes(text: str) -> list[int]:
    """The ids the tokenizer produces for ``text``, computed without it."""
    return list(text.encode("utf-8"))


def decode_bytes(ids: list[int]) -> str:
    """Inverse of ``encode_bytes``; special ids are dropped, invalid UTF-8 replaced."""
    return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")


def build_tokenizer() -> Tokenizer:
    """A ``tokenizers.Tokenizer`` whose token id for byte b is b.

    ByteLevel maps each byte to a printable unicode character; a BPE model without merges whose
    vocabulary lists those characters in byte order turns every byte into its own id.
    """
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    char_of_byte = _byte_to_char()
    assert set(char_of_byte.values()) == set(byte_chars)
    vocab = {char_of_byte[b]: b for b in range(NUM_BYTES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # use_regex=False: no word splitting, which a merge-free model does not need
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    return tok


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def write_byte_tokenizer(model_dir: str | Path) -> Path:
    """Write the three tokenizer files into ``model_dir`` (created if needed); returns the dir."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in zip((PAD_ID, BOS_ID, EOS_ID), SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # "<eos>" typed in text stays five bytes
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
    }
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out
