"""Aggregation tasks: common-word extraction (CWE) and frequent-word extraction (FWE)."""

from __future__ import annotations

import random
from collections import Counter

from .text import COMMON_WORDS, pseudo_word

NUM_CWE_ANSWERS = 3
MAX_UNCOMMON_REPEATS = 2
NUM_FWE_ANSWERS = 3
FWE_VOCAB = 20
FWE_ALPHA = 2.0


def gen_cwe(rng: random.Random, length: int):
    """CWE: a list of English words where a few words repeat far more often than the rest.

    Uncommon words appear at most twice; the common ones appear ``freq`` >= 4 times, so the
    answer set (the common words, in order of first appearance) is unambiguous.
    """
    question = "\ncommon words:"
    budget = length - len(question)
    pool = list(COMMON_WORDS)
    rng.shuffle(pool)
    common, uncommon = pool[:NUM_CWE_ANSWERS], pool[NUM_CWE_ANSWERS:]
    freq = max(4, budget // 7 // 12)
    words = [w for w in common for _ in range(freq)]
    used = sum(len(w) + 1 for w in words) - 1
    if used > budget:
        raise ValueError(f"length {length} too short for cwe")
    counts: Counter[str] = Counter()
    while True:
        candidates = [w for w in uncommon if counts[w] < MAX_UNCOMMON_REPEATS]
        word = rng.choice(candidates)
        if used + len(word) + 1 > budget:
            break
        counts[word] += 1
        words.append(word)
        used += len(word) + 1
    rng.shuffle(words)
    order = sorted(common, key=words.index)
    return " ".join(words), question, tuple(order)


def gen_fwe(rng: random.Random, length: int):
    """FWE: coded text of pseudo-words drawn from a Zipf law; the answer is the three most
    frequent words, most frequent first (redrawn until those three counts are distinct)."""
    question = "\nfrequent words:"
    budget = length - len(question)
    used_words: set[str] = set()
    vocab = [pseudo_word(rng, used_words, rng.choice((1, 2, 2, 3))) for _ in range(FWE_VOCAB)]
    weights = [1.0 / (rank + 1) ** FWE_ALPHA for rank in range(FWE_VOCAB)]
    while True:
        words: list[str] = []
        used = -1
        while True:
            word = rng.choices(vocab, weights)[0]
            if used + len(word) + 1 > budget:
                break
            words.append(word)
            used += len(word) + 1
        ranked = Counter(words).most_common(NUM_FWE_ANSWERS + 1)
        counts = [c for _, c in ranked] + [0]
        if len(set(counts[: NUM_FWE_ANSWERS + 1])) == NUM_FWE_ANSWERS + 1:
            break
    answers = tuple(w for w, _ in ranked[:NUM_FWE_ANSWERS])
    return " ".join(words), question, answers
