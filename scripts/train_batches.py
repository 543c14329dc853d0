"""Training batches of the tiny models (scripts/train_tiny.py): rows of the task suite's
instances plus training-only copy rows, with answer masks, the needle answers' attention-pointer
targets, extra questions and state-reset positions.  Every batch is a pure function of the seed
and the step number (instances from ``make_instances`` with training seeds >= 10^7, far from
evaluation seeds)."""

from __future__ import annotations

import random
import re
import string

import torch

from model_runner.byte_tokenizer import PAD_ID, encode_bytes
from model_runner.quality.tasks import TASKS, make_instances
from model_runner.quality.tasks.retrieval import single_question

TRAIN_SEED_BASE = 10_000_000
QUESTION_KEYS = re.compile(r"(?:all )?values? of ([0-9a-z -]+):$")  # S*, MK*, MQ, MV questions
NEEDLE = re.compile(r"(?:^| )([0-9a-z-]+): ([0-9a-f-]+)\.")
LENGTH_WEIGHTS = {256: 0.35, 512: 0.45, 1024: 0.15, 2048: 0.05}
TASK_WEIGHTS = {t: 1.5 if t in ("s1", "s2", "s3", "mk1") else 1.0 for t in TASKS}
COPY_ALPHABET = string.ascii_lowercase + string.digits
NEEDLE_FAMILIES = ("retrieval", "multi_key", "multi")
COPY = "copy"  # training-only source (not a suite task): a random string, then the same again


def needle_pointers(text: str, context: str, start: int, completion: str) -> list[tuple[int, int]]:
    """(position, source) pairs of a needle answer ``completion`` written at ``text[start:]``:
    the position predicting each character of each answer and that character's index in the
    answer's one needle ``key: value.`` in ``context``.  The question names one key (single and
    multi-key needles), one key per answer (multi-query) or one key for all answers
    (multi-value).  Empty for other questions or when a needle is not unique."""
    match = QUESTION_KEYS.search(text[:start])
    if match is None:
        return []
    values = completion.split()
    keys = match.group(1).split()
    keys = keys * len(values) if len(keys) == 1 else keys
    if len(keys) != len(values):
        return []
    pairs, offset = [], 1  # completion = " " + " ".join(values) + "\n"
    for key, value in zip(keys, values):
        needle = f"{key}: {value}."
        if context.count(needle) != 1:
            return []
        source = context.index(needle) + len(key) + 2
        pairs += [(start + offset - 1 + i, source + i) for i in range(len(value))]
        offset += len(value) + 1
    return pairs


def copy_row(rng: random.Random, length: int
             ) -> tuple[str, tuple[int, int], list[tuple[int, int]]]:
    """``R\nR\n`` for a random string R of about a third of ``length``: the text, the answer span
    (the repeat) and its (position, source) pointers (the position predicting each repeated
    character and that character's first occurrence).

    Every repeated character is an induction target (find the earlier occurrence of the
    current context, copy what followed), the circuit that needle retrieval is built on and
    the one small models are slowest to discover from sparse answer tokens alone.
    """
    size = rng.randrange(max(8, length // 6), max(9, length // 2 - 1))
    text = "".join(rng.choice(COPY_ALPHABET) for _ in range(size))
    pointers = [(p, p - size) for p in range(size, 2 * size)]
    return f"{text}\n{text}\n", (size + 1, 2 * size + 2), pointers


def extra_questions(context: str, rng: random.Random, count: int) -> list[tuple[str, str]]:
    """Training-only densification: up to ``count`` more (question, completion) pairs about
    other single-valued needles of the same context, asked after the real answer."""
    table: dict[str, list[str]] = {}
    for key, value in NEEDLE.findall(context):
        table.setdefault(key, []).append(value)
    keys = [k for k, values in table.items() if len(values) == 1]
    picks = rng.sample(keys, min(count, len(keys)))
    return [(single_question(k).lstrip("\n"), f" {table[k][0]}\n") for k in picks]


def make_batch(step: int, tokens_per_step: int, seed: int, num_extra: int = 0,
               length_weights: dict[int, float] | None = None,
               task_weights: dict[str, float] | None = None, state_reset: float = 0.0):
    """input ids [B, T], answer mask [B, T] (targets in the completion), valid mask [B, T],
    copy-row flags [B], pointers [N, 3] and state-reset positions [B] (-1: none).

    With ``num_extra`` > 0, needle tasks get extra questions appended (see ``extra_questions``);
    with ``state_reset`` > 0, that fraction of needle rows (retrieval, multi-key, multi-query /
    value) gets its linear state reset where the question starts (``tm.set_state_reset``).
    Both draw from their own random streams, so zeros reproduce the recorded runs.
    """
    rng = random.Random(f"train/{seed}/{step}")
    weights = length_weights or LENGTH_WEIGHTS
    length = rng.choices(list(weights), list(weights.values()))[0]
    batch = max(1, tokens_per_step // length)
    rows, spans, kinds, pointers, resets = [], [], [], [], []
    for i in range(batch):
        tasks = task_weights or TASK_WEIGHTS
        task = rng.choices(list(tasks), list(tasks.values()))[0]
        kinds.append(task == COPY)
        if task == COPY:
            text, span, row_pointers = copy_row(random.Random(f"copy/{seed}/{step}/{i}"), length)
            rows.append(encode_bytes(text))
            spans.append([span])
            pointers += [(i, p, src) for p, src in row_pointers]
            resets.append(-1)
            continue
        inst = make_instances(task, length, 1, TRAIN_SEED_BASE + step * 64 + i)[0]
        text, row_spans = inst.prompt, []
        pairs = [("", inst.completion)]
        is_needle = TASKS[task].family in NEEDLE_FAMILIES
        if num_extra and is_needle:
            extra_rng = random.Random(f"extra/{seed}/{step}/{i}")
            pairs += extra_questions(inst.context, extra_rng, num_extra)
        drop = is_needle and random.Random(f"reset/{seed}/{step}/{i}").random() < state_reset
        resets.append(len(encode_bytes(inst.context)) if drop else -1)
        for question, completion in pairs:
            text += question
            row_spans.append((len(text), len(text) + len(completion)))
            pointers += [(i, p, src) for p, src in
                         needle_pointers(text, inst.context, len(text), completion)]
            text += completion
        rows.append(encode_bytes(text))
        spans.append(row_spans)
    width = max(map(len, rows))
    ids = torch.full((batch, width), PAD_ID, dtype=torch.long)
    answer = torch.zeros(batch, width, dtype=torch.bool)  # position t predicts token t
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for b, (row, row_spans) in enumerate(zip(rows, spans)):
        ids[b, : len(row)] = torch.tensor(row)
        for start, end in row_spans:
            answer[b, start:end] = True
        valid[b, 1 : len(row)] = True
    return (ids, answer, valid, torch.tensor(kinds), torch.tensor(pointers).reshape(-1, 3),
            torch.tensor(resets))
