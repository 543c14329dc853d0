"""Question answering over a synthetic passage of facts about invented people and places.

QA-S (single hop, the SQuAD column): ``Name lives in City.`` -> where does Name live?
QA-H (two hops, the HotpotQA column): ``Name lives in City.`` + ``City is in Country.`` ->
which country does Name live in?  Every other person is a distractor; facts sit in essay filler.
"""

from __future__ import annotations

import random

from .text import essay_sentence, haystack, pseudo_word


def _people(rng: random.Random, length: int) -> tuple[list[str], list[str], list[str]]:
    used: set[str] = set()
    num_people = max(3, length // 256)
    people = [pseudo_word(rng, used, 2).capitalize() for _ in range(num_people)]
    cities = [pseudo_word(rng, used, 3).capitalize() for _ in range(num_people)]
    countries = [(pseudo_word(rng, used, 2) + "ia").capitalize() for _ in range(num_people)]
    return people, cities, countries


def gen_qa_s(rng: random.Random, length: int):
    """QA-S: one-hop fact lookup among several people."""
    people, cities, _ = _people(rng, length)
    target = rng.randrange(len(people))
    question = f"\nwhere does {people[target]} live?"
    facts = [f"{p} lives in {c}." for p, c in zip(people, cities)]
    rng.shuffle(facts)
    context = haystack(rng, length - len(question), essay_sentence, facts)
    return context, question, (cities[target],)


def gen_qa_h(rng: random.Random, length: int):
    """QA-H: two-hop lookup, person -> city -> country."""
    people, cities, countries = _people(rng, length)
    target = rng.randrange(len(people))
    question = f"\nwhich country does {people[target]} live in?"
    facts = [f"{p} lives in {c}." for p, c in zip(people, cities)]
    facts += [f"{c} is in {k}." for c, k in zip(cities, countries)]
    rng.shuffle(facts)
    context = haystack(rng, length - len(question), essay_sentence, facts)
    return context, question, (countries[target],)
