"""``dasc-eval --base-url URL``: the task suite through a running dasc-serve (the serving path).

Warm-then-replay, per instance: one warm request with the context alone (one token; when it
finishes the server checkpoints the state after the whole context), then the question as
context + question, greedy, ending at a newline.  The question must hit at exactly
len(context) (``cached_tokens``); the share of questions that did is reported as ``loaded``.
The arm is whatever the server restores (``/server_info``: dense, nr@W, wr@W, nr-int8@W,
random@W); on the same prompts and arm the answers equal the offline ``dasc-eval``'s.
Prompts go as token ids encoded with the model folder's tokenizer (``--model``).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from client import DascClient
from model_runner.quality.arms import Arm
from model_runner.quality.sweep import NEWLINE, InstanceScore, Result
from model_runner.quality.tasks import TASKS, TaskInstance, make_instances, score_instance


def answer(client: DascClient, encode, inst: TaskInstance) -> tuple[float, bool, str]:
    """(score, whether the question hit the warm context's checkpoint, the answer text)."""
    context, question = encode(inst.context), encode(inst.question)
    client.complete(context, max_tokens=1, temperature=0.0)
    out = client.complete(context + question, max_tokens=TASKS[inst.task].max_new_tokens,
                          temperature=0.0, stop_token_ids=[NEWLINE])
    cached = out.usage.cached_tokens if out.usage is not None else None
    return score_instance(inst, out.text), cached == len(context), out.text


def run_served(args: argparse.Namespace) -> tuple[list[Result], dict[tuple[str, int], float]]:
    """Results per (task, length) and the loaded share of each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    info = httpx.get(f"{args.base_url}/server_info", timeout=30,
                     headers=_auth(args.api_key)).raise_for_status().json()
    arm, model = Arm(info["arm"]), Path(info["model"]).name
    if info.get("park_finished") and arm.name != "dense":
        raise SystemExit(f"dasc-eval: {args.base_url} parks finished requests' slots, so a "
                         f"question after its warm context adopts the exact state instead of "
                         f"restoring the {arm.name} checkpoint; restart it with "
                         f"--no-park-finished to measure the arm")
    results, loaded = [], {}
    with DascClient(args.base_url, api_key=args.api_key) as client, \
            ThreadPoolExecutor(args.concurrency) as pool:
        for length in args.lengths:
            for task in args.task_list:
                insts = make_instances(task, length, args.n, args.seed)
                scored = list(pool.map(lambda inst: answer(client, encode, inst), insts))
                scores = [InstanceScore(i, score) for i, (score, _, _) in enumerate(scored)]
                results.append(Result.of(model, arm, task, length, args.seed, scores))
                loaded[(task, length)] = sum(hit for _, hit, _ in scored) / len(scored)
                print(f"[dasc-eval] {arm.name} via {args.base_url} {task} {length}: "
                      f"{results[-1].accuracy:.2f} (loaded {loaded[(task, length)]:.2f})",
                      file=sys.stderr, flush=True)
    return results, loaded


def print_json(results: list[Result], loaded: dict[tuple[str, int], float]) -> None:
    """Accuracy lines (no logit fidelity: a server returns tokens, not distributions)."""
    for r in results:
        print(json.dumps({"model": r.model, "arm": r.arm, "task": r.task, "length": r.length,
                          "accuracy": r.accuracy, "n": r.n, "seed": r.seed,
                          "loaded": loaded[(r.task, r.length)], "path": "served"}))


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
