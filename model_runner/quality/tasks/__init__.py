"""RULER-style synthetic long-context tasks for byte-level tiny models.

``TASKS`` maps a task name (the paper's RULER columns, lowercase: s1 s2 s3 mk1 mk2 mk3 mq mv
cwe fwe qa_h qa_s vt) to a ``TaskSpec`` (generator, scorer, family, decode budget).
``make_instances(task, length, n, seed)`` returns ``n`` deterministic ``TaskInstance``s whose
prompt (context + question) is at most ``length`` byte tokens; the context is the cacheable
prefix and the question the suffix.  Score a generation with ``TASKS[task].score(text, answers)``
(text after the prompt; only its first line counts).
"""

from __future__ import annotations

import random

from .aggregation import gen_cwe, gen_fwe
from .base import TaskInstance, TaskSpec, first_line, score_exact, score_recall
from .qa import gen_qa_h, gen_qa_s
from .retrieval import gen_mk1, gen_mk2, gen_mk3, gen_mq, gen_mv, gen_s1, gen_s2, gen_s3
from .tracking import gen_vt

__all__ = [
    "LENGTHS",
    "MIN_LENGTH",
    "TASKS",
    "TaskInstance",
    "TaskSpec",
    "first_line",
    "make_instances",
    "score_instance",
]

LENGTHS = (512, 1024, 2048)  # the evaluation lengths for the tiny models
MIN_LENGTH = 192  # shortest prompt every generator supports (training uses 256)

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("s1", "retrieval", gen_s1, score_exact, 16),
        TaskSpec("s2", "retrieval", gen_s2, score_exact, 16),
        TaskSpec("s3", "retrieval", gen_s3, score_exact, 16),
        TaskSpec("mk1", "multi_key", gen_mk1, score_exact, 16),
        TaskSpec("mk2", "multi_key", gen_mk2, score_exact, 16),
        TaskSpec("mk3", "multi_key", gen_mk3, score_exact, 16),
        TaskSpec("mq", "multi", gen_mq, score_recall, 24),
        TaskSpec("mv", "multi", gen_mv, score_recall, 32),
        TaskSpec("cwe", "aggregation", gen_cwe, score_recall, 32),
        TaskSpec("fwe", "aggregation", gen_fwe, score_recall, 24),
        TaskSpec("qa_h", "qa", gen_qa_h, score_exact, 16),
        TaskSpec("qa_s", "qa", gen_qa_s, score_exact, 16),
        TaskSpec("vt", "tracking", gen_vt, score_recall, 24),
    )
}


def make_instances(task: str, length: int, n: int, seed: int) -> list[TaskInstance]:
    """``n`` instances of ``task`` with prompts of at most ``length`` byte tokens.

    Instance i depends only on (task, length, seed, i): the same call always returns the same
    instances, and a larger ``n`` extends a smaller one.
    """
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if length < MIN_LENGTH:
        raise ValueError(f"length {length} < MIN_LENGTH {MIN_LENGTH}")
    spec = TASKS[task]
    instances = []
    for index in range(n):
        # str seeds hash with SHA-512 inside random.seed: stable across runs and platforms
        rng = random.Random(f"{task}/{length}/{seed}/{index}")
        context, question, answers = spec.generate(rng, length)
        instances.append(TaskInstance(task, length, seed, index, context, question, answers))
    return instances


def score_instance(instance: TaskInstance, generation: str) -> float:
    """Score the model's text after ``instance.prompt`` with the task's scorer."""
    return TASKS[instance.task].score(generation, instance.answers)
