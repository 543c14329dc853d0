"""One request as the scheduler tracks it: tokens, KV rows, state slot and cache locks."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.radix_cache import Node
from scheduler.wire.messages import SamplingParams


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    output: list[int] = field(default_factory=list)
    # KV rows of positions [0, len(rows)): [0, cached_len) belong to the tree (locked through
    # ``node``), [cached_len, len(rows)) are the request's own, reserved at admission for every
    # token it may process (prompt + max_tokens - 1).
    rows: list[int] = field(default_factory=list)
    cached_len: int = 0
    node: Node | None = None
    slot: int = 0  # active state slot; holds the state after ``computed`` tokens
    computed: int = 0
    hit_len: int = 0  # tokens restored from the cache at admission (usage.cached_tokens)
    # (boundary, checkpoint slot) of each store this step, in prompt order
    pending_stores: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = 0  # order of add(); ties in the schedule policy go to the earlier
    num_passed: int = 0  # later arrivals that got prefill in a step where this one got none
    # SamplingParams.prompt_logprobs: what the prefill steps returned so far, sent (and
    # dropped) with the first token's frame
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_tokens[start:end]`` without building the whole list (a decode step's token)."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:end] + self.output[: max(0, end - n)]

    @property
    def is_prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def own_rows(self) -> list[int]:
        return self.rows[self.cached_len :]

    @property
    def max_processed(self) -> int:
        """Tokens the request may feed through the model: the last sampled one never is."""
        return len(self.prompt) + self.sampling.max_tokens - 1
