"""Quick accuracy check of a tiny model on the task suite: greedy decoding with transformers.

This is the training script's own sanity check (fla blocked, pure-torch paths, one prompt at a
time); the real offline evaluation goes through dasc's runner.
"""

from __future__ import annotations

import time

import tiny_models  # noqa: F401  (blocks fla before transformers models are used)
import torch

from model_runner.byte_tokenizer import EOS_ID, PAD_ID, decode_bytes, encode_bytes
from model_runner.quality.tasks import TASKS, make_instances, score_instance

NEWLINE_ID = ord("\n")


def greedy_answer(model, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy continuation of ``prompt``, up to its first newline."""
    ids = torch.tensor([encode_bytes(prompt)])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[NEWLINE_ID, EOS_ID],
        pad_token_id=PAD_ID,
    )
    return decode_bytes(out[0, ids.shape[1]:].tolist())


@torch.no_grad()
def quick_eval(model, lengths: list[int], num_per_task: int, seed: int = 0,
               tasks: list[str] | None = None, log=print) -> dict[str, dict[int, float]]:
    """Mean score per task and length over ``num_per_task`` instances (seeded, deterministic)."""
    model.eval()
    results: dict[str, dict[int, float]] = {}
    for task in tasks or list(TASKS):
        results[task] = {}
        for length in lengths:
            start = time.time()
            scores = []
            for inst in make_instances(task, length, num_per_task, seed):
                text = greedy_answer(model, inst.prompt, TASKS[task].max_new_tokens)
                scores.append(score_instance(inst, text))
            results[task][length] = sum(scores) / len(scores)
            log(f"eval {task:5s} len={length:5d} acc={results[task][length]:.2f} "
                f"({time.time() - start:.0f}s) last={text!r} gold={inst.answers}")
    return results


def family_table(results: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Mean score per task family and length."""
    table: dict[str, dict[int, list[float]]] = {}
    for task, by_len in results.items():
        fam = table.setdefault(TASKS[task].family, {})
        for length, acc in by_len.items():
            fam.setdefault(length, []).append(acc)
    return {f: {n: sum(v) / len(v) for n, v in d.items()} for f, d in table.items()}
