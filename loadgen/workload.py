"""Workloads: lists of ``Request``s, exact for any tokenizer because prompts are token ids.

``shared_prefix``  SGLang's generated-shared-prefix: G groups x P prompts, each group one random
                   prefix of L tokens, each prompt that prefix plus its own random question of S
                   tokens.  The first prompt of a group is tagged cold, the rest warm; the warm
                   ones wait for their cold one (``depends_on``), so they can hit its prefix.
``multi_turn``     G conversations x P turns: turn 1 is a random context of L tokens plus S
                   tokens of question, turn k is turn k-1's prompt plus S new tokens (the model's
                   reply is stood in for by random tokens, so every arm sees the same prompts).
                   Turn k waits for turn k-1; the seed shuffles which conversations start first.
                   ``system_len`` > 0 puts one random system prompt of that many tokens before
                   every conversation (an agent's tools and instructions, shared by all users).
``read_prompt_file`` JSON lines ``{"prompt": text | [ids], "max_tokens"?: n, "warmup"?: bool}``.

The phase workload of the paper (appendix C.2) lives in ``loadgen.phases``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Request:
    prompt: list[int] | str
    max_tokens: int = 1
    is_warmup: bool = False  # sent first, in order, never timed nor summarised
    depends_on: int | None = None  # index (same list) of a request that must finish first
    tags: dict = field(default_factory=dict)  # group / turn / phase ..., copied to the result
    # chat turns: ``prompt`` holds only the new tokens; the request sent is the previous turn's
    # prompt + its reply (token ids the server returned) + these, as a chat client resends them
    extends_reply: bool = False
    returns_ids: bool = False  # ask for the reply's token ids (a later turn extends it)


def random_ids(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    lo, hi = token_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def shared_prefix(num_groups: int, prompts_per_group: int, prefix_len: int, suffix_len: int,
                  token_range: tuple[int, int], seed: int, max_tokens: int = 1
                  ) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    for g in range(num_groups):
        prefix = random_ids(rng, prefix_len, token_range)
        first = len(out)
        for i in range(prompts_per_group):
            prompt = prefix + random_ids(rng, suffix_len, token_range)
            out.append(Request(prompt, max_tokens, depends_on=None if i == 0 else first,
                               tags={"group": g, "index": i, "cold": i == 0}))
    return out


def multi_turn(num_conversations: int, num_turns: int, context_len: int, turn_len: int,
               token_range: tuple[int, int], seed: int, max_tokens: int = 1,
               dataset_seed: int = 0, with_replies: bool = False, system_len: int = 0
               ) -> list[Request]:
    """The prompts depend on ``dataset_seed`` only; ``seed`` orders the conversations.  Turn k
    extends turn k-1's prompt; ``with_replies``: its prompt and reply, as chat clients send."""
    rng = random.Random(dataset_seed)
    system = random_ids(random.Random(f"system-{dataset_seed}"), system_len, token_range)
    conversations = []
    for c in range(num_conversations):
        prompt = system + random_ids(rng, context_len, token_range)
        turns = []
        for t in range(num_turns):
            new = random_ids(rng, turn_len, token_range)
            prompt = prompt + new
            follows = with_replies and t > 0
            turns.append(Request(new if follows else prompt, max_tokens,
                                 tags={"conversation": c, "turn": t, "cold": t == 0},
                                 extends_reply=follows,
                                 returns_ids=with_replies and t < num_turns - 1))
        conversations.append(turns)
    random.Random(seed).shuffle(conversations)
    out: list[Request] = []
    # Interleave turns (all first turns, then all second turns ...) so that a concurrency
    # window covers many conversations, as bench_multiturn's clients do.
    index: dict[tuple[int, int], int] = {}
    for t in range(num_turns):
        for turns in conversations:
            req = turns[t]
            c = req.tags["conversation"]
            req.depends_on = index.get((c, t - 1))
            index[(c, t)] = len(out)
            out.append(req)
    return out


class PromptFileError(ValueError):
    pass


def read_prompt_file(path: str | Path, default_max_tokens: int = 1) -> list[Request]:
    """Warm-up lines keep their file order and come first."""
    warm, timed = [], []
    for num, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}:{num}: not JSON ({e})") from e
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise PromptFileError(f"{path}:{num}: 'prompt' must be a non-empty string or a "
                                  "list of token ids")
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise PromptFileError(f"{path}:{num}: 'max_tokens' must be a positive integer")
        is_warmup = bool(obj.get("warmup", False))
        req = Request(prompt, max_tokens, is_warmup=is_warmup, tags={"line": num})
        (warm if is_warmup else timed).append(req)
    if not timed:
        raise PromptFileError(f"{path}: no timed (non-warm-up) prompt")
    return warm + timed
