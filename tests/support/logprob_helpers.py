"""Log probabilities as OpenAI shapes them, read back from the official ``openai`` client: how a
token of the built-in byte tokenizer is named, and a completions stream's logprobs pieces
joined."""

from __future__ import annotations

from support.serving import EOS


def text_of(token_id: int) -> str:
    """How OpenAI names a token of the built-in byte tokenizer: its text, ``bytes:\\xNN`` for
    part of a character, a special token by its name."""
    if token_id == EOS:
        return "<eos>"
    return chr(token_id) if token_id < 128 else f"bytes:\\x{token_id:02x}"


def joined_logprobs(chunks) -> tuple[list, list, list, list]:
    """A completions stream's logprobs pieces joined: (tokens, token_logprobs, top_logprobs,
    text_offset), to compare with the JSON answer's."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    return tokens, logprobs, tops, offsets
