"""Structured output on rank 0: an llguidance matcher per request, and its token mask.

The front end turns ``response_format`` (and forced tool calls) into an llguidance grammar
(``dasc_server.requests``); the grammar travels once, in the request's ``LogitControls``.
Rank 0 builds an ``LLMatcher`` over the model's own tokenizer, asks it before every sample which
tokens may follow, and feeds it the token sampled.  A row's mask comes from its own matcher
only, so structured output keeps the sampler batch-invariant.

The tokenizer is built once, on the first request that needs it (~5 ms for the byte tokenizer
of the built-in models; llguidance quotes ~1 s for a 150k-token vocabulary).  The model's EOS
is the grammar's end token: once the output is complete, EOS is the only token allowed.

Added tokens that are text, not special (Qwen's ``<tool_call>``, ``<think>``, ...), are left out
of llguidance's view: llguidance 1.x takes every added token for a special one, yet forces one
whose text is the grammar's next text, and then refuses it when it is consumed (the answer
ended there).  Without them the grammar's text is spelled with ordinary tokens, which decode to
the same characters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llguidance
import numpy as np
import torch


def grammar_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_id: int | None
                      ) -> llguidance.LLTokenizer:
    """The model's Hugging Face fast tokenizer as llguidance sees it, ``vocab_size`` wide (ids
    past the tokenizer's own are never allowed)."""
    import llguidance.hf  # imports transformers (~0.8 s): only once a request has a grammar
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    raw = json.loads(hf.backend_tokenizer.to_str())
    raw["added_tokens"] = [t for t in raw.get("added_tokens", []) if t.get("special")]
    text_only = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)))
    eos = eos_token_id if eos_token_id is not None else hf.eos_token_id
    return llguidance.hf.from_tokenizer(text_only, n_vocab=vocab_size, eos_token=eos)


class TokenizerCache:
    """Builds the grammar tokenizer on first use (requests without a grammar never do)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_id: int | None):
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None

    def __call__(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = grammar_tokenizer(self.model_dir, self.vocab_size,
                                                self.eos_token_id)
        return self._tokenizer


class GrammarMatcher:
    """One request's grammar state.  A grammar that cannot be built here (no tokenizer in the
    model folder, or a grammar the front end's validation let through) allows only EOS, so
    the request ends instead of the rank; the reason goes to stderr."""

    def __init__(self, tokenizer: TokenizerCache, grammar: str, vocab_size: int):
        self.vocab_size, self.eos = vocab_size, tokenizer.eos_token_id
        self.matcher: llguidance.LLMatcher | None = None
        try:
            self.matcher = llguidance.LLMatcher(tokenizer(), grammar, log_level=0)
        except Exception as e:  # the tokenizer failed to load: end the request, not the rank
            print(f"dasc grammar error: {type(e).__name__}: {e}", file=sys.stderr)
        self._report()

    @property
    def is_broken(self) -> bool:
        return self.matcher is None or self.matcher.is_error()

    def allowed(self, device: torch.device) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next."""
        if self.is_broken:
            only_eos = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            if self.eos is not None:
                only_eos[self.eos] = True
            return only_eos
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.zeros(self.vocab_size, dtype=bool)  # logits wider than the tokenizer: False
        unpacked = np.unpackbits(bits, bitorder="little")[: self.vocab_size]
        mask[: unpacked.size] = unpacked
        return torch.from_numpy(mask).to(device)

    def consume(self, token: int) -> None:
        if not self.is_broken:
            self.matcher.consume_token(token)
            self._report()

    def _report(self) -> None:
        if self.matcher is not None and self.matcher.is_error():
            print(f"dasc grammar error: {self.matcher.get_error()}", file=sys.stderr)
