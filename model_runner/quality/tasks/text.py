"""Text material for the synthetic tasks: fillers, random keys and values, haystack assembly.

Everything is ASCII, so one character is one byte token of the byte-level tokenizer and a
context's length in characters is its length in tokens.  All randomness comes from the
``random.Random`` passed in, which makes every instance a pure function of its seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_SUBJECTS = (
    "the old city", "a quiet river", "my best friend", "the young teacher", "every child",
    "the tall tower", "a small boat", "the winter wind", "our neighbour", "the busy market",
    "a lonely bird", "the new bridge", "the kind doctor", "a patient farmer", "the school band",
)
_VERBS = (
    "remembers", "carries", "watches", "builds", "finds", "follows", "paints", "hears",
    "protects", "crosses", "shapes", "welcomes", "answers", "changes", "keeps",
)
_OBJECTS = (
    "a long road", "the morning light", "an open door", "the green hills", "a forgotten song",
    "the heavy rain", "a simple story", "the far coast", "a warm room", "the empty streets",
    "a bright idea", "the last train", "the cold sea", "a paper map", "the evening bells",
)
_TAILS = (
    "at night", "in the spring", "without a word", "every morning", "after the storm",
    "before dinner", "with great care", "for many years", "on most days", "near the end",
    "again and again", "in the end", "as always", "from time to time", "all summer",
)

COMMON_WORDS = tuple(
    """
    apple river stone cloud table window garden forest winter summer doctor pencil bottle
    candle mirror basket bridge castle engine finger flower guitar hammer island jacket kettle
    ladder marble needle orange pillow rabbit saddle tunnel violin wallet yellow zipper anchor
    barrel carpet dragon feather glove helmet insect jungle kitten lemon magnet napkin ocean
    parrot quilt rocket shadow tomato umbrella valley wagon button cabin dinner eagle fabric
    goose harbor iron jelly kingdom lantern meadow noodle onion pepper puzzle rubber salad
    ticket uncle velvet walnut yogurt zebra acorn beacon cactus daisy ember falcon ginger
    hollow ivory juice kayak lizard maple nectar olive pebble quiver raven silver thunder
    tulip vapor willow arrow blanket camera desert elbow fossil gravel hornet igloo jigsaw
    koala lobster mango nickel orchid panda radish sponge turtle utensil vessel whistle banjo
    cobalt dolphin emerald fountain goblin hazel icicle jasmine kernel lotus mitten nugget
    oyster pirate quartz ribbon saucer timber unicorn vortex waffle badger copper denim
    easel fiddle glacier harp inkwell jester knapsack lagoon muffin nutmeg oatmeal plum
    riddle sapphire trumpet urchin vinyl walrus bison comet donkey
    """.split()
)

_CONSONANTS = "bcdfgklmnprstvz"
_VOWELS = "aeiou"


def noise_cycle(rng: random.Random) -> Callable[[random.Random], str]:
    """RULER's noise haystack: the five fixed sentences repeated in order from a random start."""
    position = rng.randrange(len(NOISE_SENTENCES))

    def next_sentence(_: random.Random) -> str:
        nonlocal position
        position = (position + 1) % len(NOISE_SENTENCES)
        return NOISE_SENTENCES[position]

    return next_sentence


def essay_sentence(rng: random.Random) -> str:
    """One sentence of essay-like filler from a small grammar (no digits, no colons)."""
    text = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return f"{text} {rng.choice(_TAILS)}.".capitalize()


def random_key(rng: random.Random, used: set[str], num_letters: int = 5) -> str:
    """A fresh lowercase key such as ``kqzvb``, distinct from every key in ``used``."""
    while True:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(num_letters))
        if key not in used:
            used.add(key)
            return key


def random_number(rng: random.Random, used: set[str], num_digits: int = 5) -> str:
    """A fresh number with ``num_digits`` digits (no leading zero)."""
    while True:
        value = str(rng.randrange(10 ** (num_digits - 1), 10**num_digits))
        if value not in used:
            used.add(value)
            return value


def random_uuid(rng: random.Random, used: set[str]) -> str:
    """A fresh short uuid-like value such as ``3f9a-1c2e`` (two groups of 4 hex digits)."""
    while True:
        value = "-".join("".join(rng.choice("0123456789abcdef") for _ in range(4)) for _ in "ab")
        if value not in used:
            used.add(value)
            return value


def pseudo_word(rng: random.Random, used: set[str], num_syllables: int = 2) -> str:
    """A fresh pronounceable lowercase non-word such as ``tamovi``."""
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(num_syllables))
        if word not in used:
            used.add(word)
            return word


def haystack(
    rng: random.Random,
    budget: int,
    sentence: Callable[[random.Random], str],
    needles: list[str],
) -> str:
    """Filler sentences joined by spaces with ``needles`` inserted, in the given order, at
    random sentence boundaries; at most ``budget`` characters, filled to within one sentence.

    Needle order is kept so that chains (variable tracking) read forward.
    """
    needle_len = sum(len(n) + 1 for n in needles)
    if needle_len > budget:
        raise ValueError(f"needles need {needle_len} characters, budget is {budget}")
    fillers: list[str] = []
    used = needle_len - 1
    while True:
        nxt = sentence(rng)
        if used + len(nxt) + 1 > budget:
            break
        fillers.append(nxt)
        used += len(nxt) + 1
    slots = sorted(rng.randint(0, len(fillers)) for _ in needles)
    parts: list[str] = []
    cursor = 0
    for slot, needle in zip(slots, needles):
        parts.extend(fillers[cursor:slot])
        parts.append(needle)
        cursor = slot
    parts.extend(fillers[cursor:])
    return " ".join(parts)
