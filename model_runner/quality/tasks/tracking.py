"""Variable tracking (VT): follow a chain of assignments ``VAR b = a.`` back to a value."""

from __future__ import annotations

import random

from .text import haystack, noise_cycle, random_key, random_number

NUM_HOPS = 3
NUM_DISTRACTOR_CHAINS = 1


def _chain(rng: random.Random, names: set[str], values: set[str]) -> tuple[str, list[str], list]:
    value = random_number(rng, values)
    chain = [random_key(rng, names, 4) for _ in range(NUM_HOPS)]
    lines = [f"VAR {chain[0]} = {value}."]
    lines += [f"VAR {b} = {a}." for a, b in zip(chain, chain[1:])]
    return value, chain, lines


def gen_vt(rng: random.Random, length: int):
    """VT: one chain plus distractor chains in noise; the answer is every variable of the chain
    whose value is asked, in assignment order.  Statements of all chains interleave, each chain
    in its own order."""
    names: set[str] = set()
    values: set[str] = set()
    value, chain, lines = _chain(rng, names, values)
    chains = [lines] + [_chain(rng, names, values)[2] for _ in range(NUM_DISTRACTOR_CHAINS)]
    # Interleave the chains randomly but keep each chain's statements in order.
    statements: list[str] = []
    cursors = [0] * len(chains)
    while any(c < len(ch) for c, ch in zip(cursors, chains)):
        live = [i for i, ch in enumerate(chains) if cursors[i] < len(ch)]
        i = rng.choice(live)
        statements.append(chains[i][cursors[i]])
        cursors[i] += 1
    question = f"\nvars equal to {value}:"
    context = haystack(rng, length - len(question), noise_cycle(rng), statements)
    return context, question, tuple(chain)
