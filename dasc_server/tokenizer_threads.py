"""Tokenizer work off the event loop.

Turning a request into token ids (rendering a chat template, encoding the text) runs in a small
thread pool, so a long prompt never stalls the other requests' streams: Hugging Face's Rust
tokenizers release the GIL while they encode (a 2.2 MB prompt took 2.4 s to encode here while
the loop's thread went on, its longest pause 44 ms).  Each worker thread encodes with its own
copy of the tokenizer, since a fast tokenizer's settings are mutable state that concurrent
calls can trip over.  Two workers: a short request is not queued behind one long one.

A text that cannot fit the context whatever its tokenization (more bytes than the context's
tokens times the vocabulary's longest token) is refused before it is encoded.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dasc_server.request_errors import RequestError

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
