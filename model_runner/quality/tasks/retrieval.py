"""Needle-in-a-haystack tasks: single needle (S1-S3), multi-key (MK1-MK3), multi-query (MQ)
and multi-value (MV).  A needle is one ``key: value.`` sentence; keys are random letters."""

from __future__ import annotations

import random
from collections.abc import Callable

from .text import essay_sentence, haystack, noise_cycle, random_key, random_number, random_uuid

NUM_MK_DISTRACTORS = 3
NUM_MQ_NEEDLES, NUM_MQ_QUERIES = 4, 2
NUM_MV_VALUES = 4

Value = Callable[[random.Random, set[str]], str]


def needle(key: str, value: str) -> str:
    return f"{key}: {value}."


def single_question(key: str) -> str:
    return f"\nvalue of {key}:"


def _single(rng: random.Random, length: int, is_noise: bool, value_fn: Value):
    keys: set[str] = set()
    values: set[str] = set()
    key, value = random_key(rng, keys), value_fn(rng, values)
    question = single_question(key)
    filler = noise_cycle(rng) if is_noise else essay_sentence
    context = haystack(rng, length - len(question), filler, [needle(key, value)])
    return context, question, (value,)


def gen_s1(rng: random.Random, length: int):
    """S1: number needle in repeated noise."""
    return _single(rng, length, True, random_number)


def gen_s2(rng: random.Random, length: int):
    """S2: number needle in essay-like filler."""
    return _single(rng, length, False, random_number)


def gen_s3(rng: random.Random, length: int):
    """S3: uuid-like needle in essay-like filler."""
    return _single(rng, length, False, random_uuid)


def gen_mk1(rng: random.Random, length: int):
    """MK1: the target needle plus distractor needles with other keys, in essay filler."""
    keys: set[str] = set()
    values: set[str] = set()
    pairs = [
        (random_key(rng, keys), random_number(rng, values)) for _ in range(1 + NUM_MK_DISTRACTORS)
    ]
    key, value = pairs[0]
    question = single_question(key)
    needles = [needle(k, v) for k, v in pairs]
    rng.shuffle(needles)
    context = haystack(rng, length - len(question), essay_sentence, needles)
    return context, question, (value,)


def _all_needles(rng: random.Random, length: int, key_fn: Value, value_fn: Value):
    keys: set[str] = set()
    values: set[str] = set()
    key, value = key_fn(rng, keys), value_fn(rng, values)
    question = single_question(key)

    def distractor(r: random.Random) -> str:
        return needle(key_fn(r, keys), value_fn(r, values))

    context = haystack(rng, length - len(question), distractor, [needle(key, value)])
    return context, question, (value,)


def gen_mk2(rng: random.Random, length: int):
    """MK2: the whole haystack is needles (number values); one of them is asked for."""
    return _all_needles(rng, length, random_key, random_number)


def gen_mk3(rng: random.Random, length: int):
    """MK3: a haystack of needles whose keys and values are both uuid-like."""
    return _all_needles(rng, length, random_uuid, random_uuid)


def gen_mq(rng: random.Random, length: int):
    """MQ: several needles; the question asks for the values of some of their keys, in order."""
    keys: set[str] = set()
    values: set[str] = set()
    pairs = [(random_key(rng, keys), random_number(rng, values)) for _ in range(NUM_MQ_NEEDLES)]
    asked = rng.sample(pairs, NUM_MQ_QUERIES)
    question = "\nvalues of " + " ".join(k for k, _ in asked) + ":"
    needles = [needle(k, v) for k, v in pairs]
    rng.shuffle(needles)
    context = haystack(rng, length - len(question), essay_sentence, needles)
    return context, question, tuple(v for _, v in asked)


def gen_mv(rng: random.Random, length: int):
    """MV: one key appears with several values; the answer is all of them (set recall)."""
    keys: set[str] = set()
    values: set[str] = set()
    key = random_key(rng, keys)
    answers = tuple(random_number(rng, values) for _ in range(NUM_MV_VALUES))
    question = f"\nall values of {key}:"
    needles = [needle(key, v) for v in answers]  # haystack keeps order: answers as they appear
    context = haystack(rng, length - len(question), essay_sentence, needles)
    return context, question, answers
