"""Tokenizing off the event loop (a thread pool, lengths refused before any long text is
encoded) and incremental detokenizing of each choice's tokens into text deltas."""

from __future__ import annotations

import asyncio
import codecs
import copy
import functools
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dasc_server.requests import RequestError

# Tokenizer work off the event loop.
#
# Turning a request into token ids (rendering a chat template, encoding the text) runs in a small
# thread pool, so a long prompt never stalls the other requests' streams: Hugging Face's Rust
# tokenizers release the GIL while they encode (a 2.2 MB prompt took 2.4 s to encode here while
# the loop's thread went on, its longest pause 44 ms).  Each worker thread encodes with its own
# copy of the tokenizer, since a fast tokenizer's settings are mutable state that concurrent
# calls can trip over.  Two workers: a short request is not queued behind one long one.
#
# A text that cannot fit the context whatever its tokenization (more bytes than the context's
# tokens times the vocabulary's longest token) is refused before it is encoded.

T = TypeVar("T")
WORKERS = 2


class TokenizerThreads:
    def __init__(self, tokenizer: Any | None, max_context_len: int):
        self.tokenizer, self.max_context_len = tokenizer, max_context_len
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="dasc-tokenize")
        self._local = threading.local()
        self.in_flight = 0
        # bytes of the longest token's text (UTF-8 of its vocabulary string: an upper bound)
        self.max_token_bytes = max((len(t.encode()) for t in tokenizer.get_vocab()),
                                   default=1) if tokenizer is not None else 1

    def here(self) -> Any:
        """The calling thread's tokenizer: its own copy in a worker thread."""
        if threading.current_thread() is threading.main_thread() or self.tokenizer is None:
            return self.tokenizer
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool; ``in_flight`` counts the calls not yet returned (read and
        written on the event loop's thread only)."""
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.in_flight -= 1

    def check_fits(self, text: str, param: str) -> None:
        """Refuse a text too long for the context before encoding it."""
        limit = self.max_context_len * self.max_token_bytes
        if len(text) > limit:  # characters <= UTF-8 bytes: a cheap first look
            size = len(text.encode())
            if size > limit:
                raise RequestError(
                    f"the {param} has {size:,} bytes of text; at most {limit:,} can fit the "
                    f"context of {self.max_context_len:,} tokens (tokens of at most "
                    f"{self.max_token_bytes} bytes)", param=param)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# Incremental detokenisation with stop strings, one ``IncrementalDetokenizer`` per request.
#
# Token ids arrive a few at a time; text must leave as soon as it is final and never twice.
# Two things can make the end of the decoded text provisional:
#
# * an unfinished character: a byte-level token may carry half of a UTF-8 sequence, which decodes
#   to U+FFFD until the rest arrives.  Like vLLM/SGLang we keep ``[prefix_offset, read_offset)``
#   (ids already emitted, kept as context because many tokenizers decode a token differently at
#   the start of a string, e.g. SentencePiece's leading space) and decode
#   ``ids[prefix_offset:]``; the text beyond the decoded prefix window is new, and it is emitted
#   only when it does not end in U+FFFD;
# * a stop string that may be forming: the longest tail of the pending text that is a prefix of
#   some stop string is held back.  When a stop string appears, the text is cut just before its
#   first occurrence and ``stopped`` becomes true; nothing is emitted after that.
#
# Special tokens (eos, bos, pad) are skipped when decoding, so they never appear as text.
# ``flush()`` at the end releases what is still held (an unfinished character comes out as
# U+FFFD, a partial stop string as plain text).

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt ids kept as decoding context for the first new tokens


class IncrementalDetokenizer:
    """Turns the generated ids of one request into text deltas.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=True) -> str``; ``None`` means no
    text at all (every delta is ""), for servers whose model folder has no tokenizer.

    Invariant: ``ids[:read_offset]`` has been turned into text; of that text everything except
    ``_pending`` has been emitted, and ``_pending`` is a (possibly empty) proper prefix of a
    stop string, or empty when there are no stop strings.
    """

    __slots__ = ("tokenizer", "stop", "ids", "prefix_offset", "read_offset", "_pending",
                 "stopped", "stop_string")

    def __init__(self, tokenizer: Any | None, stop: Iterable[str] = (),
                 prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if tokenizer is not None else []
        # A context that is itself mid-character would shift the offsets of the first delta.
        if context and REPLACEMENT_CHAR in self._decode(context):
            context = []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._pending = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched

    def step(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became final (possibly "")."""
        if self.stopped or self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """The request finished: return everything still held back."""
        if self.stopped or self.tokenizer is None:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decode_new(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        # Wait for the rest of a character; at the end there is no rest to wait for.
        if not final and (len(full_text) <= len(prefix_text)
                          or full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def _release(self, new_text: str, final: bool) -> str:
        text = self._pending + new_text
        self._pending = ""
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return text[:cut]
        if not final:
            held = self._partial_stop_len(text)
            if held:
                text, self._pending = text[:-held], text[-held:]
        return text

    def _first_stop(self, text: str) -> int | None:
        """Start of the stop string that completes first in ``text`` (ties: the one that starts
        first), recording which one.  Ranking by end, not start, makes the cut independent of
        how the ids were grouped into steps: generation would have ended at that end."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best, self.stop_string = (i + len(s), i), s
        return None if best is None else best[1]

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


# ---- single tokens, as OpenAI's logprobs name them ---------------------------------------------


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    others for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1 << 16)
def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for (a special token: its name).  A byte-level BPE token may
    hold part of a character, so its bytes, not ``decode([id])`` (U+FFFD), say which it is."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    if byte_level and isinstance(piece, str) and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    match = _SENTENCEPIECE_BYTE.fullmatch(piece or "")
    if match:
        return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_text(raw: bytes) -> str:
    """A token's text; part of a character is written as OpenAI writes it, ``bytes:\\xNN``."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """``text_offset`` of each generated token: the characters of the completion before it,
    counting a character once all its bytes have arrived."""

    __slots__ = ("_decoder", "num_chars")

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def step(self, raw: bytes) -> int:
        """The offset of the token with bytes ``raw``; then count its characters."""
        offset = self.num_chars
        self.num_chars += len(self._decoder.decode(raw))
        return offset
