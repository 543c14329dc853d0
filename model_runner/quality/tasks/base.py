"""Task instance, task spec and the scorers shared by all synthetic RULER-style tasks.

Prompt layout (what the quality harness relies on):  ``context + question`` is the prompt; the
context is the part cached as a prefix, the question (which starts with a newline) is the suffix.
The model's expected completion is ``instance.completion``: a space, the gold answers joined by
single spaces, and a newline.  Predictions are read up to the first newline.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# (rng, prompt length in bytes) -> (context, question, gold answers in canonical order)
Generator = Callable[[random.Random, int], tuple[str, str, tuple[str, ...]]]
Scorer = Callable[[str, tuple[str, ...]], float]

_STRIP = ".,;:!?\"'()[]"


@dataclass(frozen=True, slots=True)
class TaskInstance:
    """One test case.  ``len(context) + len(question) <= length`` (ASCII: bytes == chars)."""

    task: str
    length: int  # target prompt length in byte tokens
    seed: int
    index: int
    context: str  # cached prefix
    question: str  # suffix; starts with "\n", ends where the answer starts
    answers: tuple[str, ...]  # gold answers; order is the canonical training order

    @property
    def prompt(self) -> str:
        return self.context + self.question

    @property
    def completion(self) -> str:
        """The exact text a perfect model generates after the prompt (training target)."""
        return " " + " ".join(self.answers) + "\n"


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A registry entry: how to generate instances and how to score a prediction."""

    name: str
    family: str  # retrieval | multi_key | multi | aggregation | qa | tracking
    generate: Generator
    score: Scorer  # (prediction text, gold answers) -> score in [0, 1]
    max_new_tokens: int  # decode budget that fits the longest gold completion


def first_line(text: str) -> str:
    """A prediction is what the model writes before its first newline."""
    return text.split("\n", 1)[0]


def answer_items(text: str) -> list[str]:
    """Whitespace/comma separated items of a prediction, lowercased, outer punctuation removed."""
    items = (w.strip(_STRIP).lower() for w in first_line(text).replace(",", " ").split())
    return [w for w in items if w]


def score_exact(prediction: str, answers: tuple[str, ...]) -> float:
    """1.0 iff the first predicted item equals the (single) gold answer, case-insensitively."""
    items = answer_items(prediction)
    return float(bool(items) and items[0] == answers[0].lower())


def score_recall(prediction: str, answers: tuple[str, ...]) -> float:
    """Set recall of the gold answers among the first ``len(answers)`` predicted items.

    Only as many items as there are answers count, so listing extra guesses cannot raise the
    score; order does not matter.
    """
    items = set(answer_items(prediction)[: len(answers)])
    return sum(a.lower() in items for a in answers) / len(answers)
