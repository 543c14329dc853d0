"""``dasc-eval``: task-suite accuracy through dasc's runner, with the cached-prefix protocol.

Per instance: prefill the context (the cacheable prefix), apply the arm's transformation to
what the cache would hold, then prefill the question suffix on top and decode greedily until a
newline.  Arms: ``dense`` (nothing), ``nr@W`` (store the prefix state as a dasc checkpoint at
W_max = W and load it back: omitted units zero-filled), ``wr@W`` (nr, then the omitted units
are refreshed by replaying the last W_wr context tokens), ``nr-int8@W`` (INT8 payload),
``random@W`` (count-matched random selection, seed 1234), and the Table 1(a) interventions
``zero-full-kv``, ``zero-linear``, ``zero-both`` (zero the context's full-attention KV rows,
the linear-attention state, or both).  Instances run in batches; every TP rank runs the same
loop and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from loadgen.tasks import LENGTHS, TASKS, TaskInstance, make_instances, score_instance
from model_runner.batch import SeqInput
from model_runner.engine import decode_until
from model_runner.launch import is_first_rank, is_rank_process, relaunch
from model_runner.runner import ModelRunner

INTERVENTIONS = ("zero-full-kv", "zero-linear", "zero-both")
COMPRESSED = ("nr", "wr", "nr-int8", "random")
RANDOM_SEED = 1234
NEWLINE = 10


@dataclass(frozen=True, slots=True)
class Result:
    arm: str
    task: str
    length: int
    accuracy: float
    n: int


def parse_arm(arm: str) -> tuple[str, float]:
    """"dense" | intervention | "<kind>@<W_max>" -> (kind, W_max)."""
    if arm == "dense" or arm in INTERVENTIONS:
        return arm, 0.0
    kind, _, w = arm.partition("@")
    try:
        w_max = float(w)
    except ValueError:
        w_max = -1.0
    if kind not in COMPRESSED or w_max <= 0:
        raise ValueError(f"unknown arm {arm!r}: use dense, {', '.join(INTERVENTIONS)} or "
                         f"{'|'.join(COMPRESSED)}@W_MAX (e.g. nr@16)")
    return kind, w_max


def prepare_arm(runner: ModelRunner, arm: str, batch: int) -> None:
    """Attach the checkpoint pool a compressed arm stores through."""
    from model_runner.compression.checkpoint import CheckpointFormat
    from model_runner.compression.horizons import static_horizons
    from model_runner.compression.plan import dasc_plan, random_plan
    from model_runner.compression.weights import load_decay_params

    kind, w_max = parse_arm(arm)
    if kind not in COMPRESSED:
        return
    horizons = static_horizons(runner.cfg, load_decay_params(runner.rc.model_dir, runner.cfg))
    plan = dasc_plan(runner.identity(), horizons, w_max)
    if kind == "random":
        plan = random_plan(plan, horizons, RANDOM_SEED)
    payload = "int8" if kind == "nr-int8" else "fp32"
    runner.attach_checkpoints(plan, batch, CheckpointFormat(payload=payload))


def apply_arm(runner: ModelRunner, seqs: list[SeqInput], arm: str,
              contexts: list[list[int]] | None = None) -> None:
    """What a cache hit on each sequence's prefix [0, prefix_len) would restore.  ``wr`` needs
    the context ids and as many spare state slots after the batch's as there are sequences."""
    kind, _ = parse_arm(arm)
    if kind in COMPRESSED:
        slots = [s.state_slot for s in seqs]
        ckpt = list(range(len(seqs)))
        runner.store_checkpoints(slots, ckpt)
        runner.zero_state_slots(slots)
        runner.load_checkpoints(ckpt, slots)
        window = runner.checkpoints.plan.refresh_window
        if kind == "wr" and window > 0:
            replay = []
            for s, ctx in zip(seqs, contexts):
                start = max(0, len(ctx) - window)
                replay.append(SeqInput(ctx[start:], start, s.page_table, s.state_slot))
            scratch = [max(slots) + 1 + i for i in range(len(seqs))]
            runner.refresh_omitted(replay, scratch)
    else:
        apply_intervention(runner, seqs, kind)


def apply_intervention(runner: ModelRunner, seqs: list[SeqInput], kind: str) -> None:
    """Zero what the cache holds for each sequence's prefix [0, prefix_len)."""
    if kind in ("zero-full-kv", "zero-both"):
        page = runner.rc.page_size
        for s in seqs:
            pos = torch.arange(s.prefix_len)
            pages = torch.tensor(s.page_table)[pos // page]
            rows = (pages * page + pos % page).to(runner.device)
            for cache in runner.kv.caches:
                cache[rows] = 0
    if kind in ("zero-linear", "zero-both"):
        for s in seqs:
            runner.zero_state(s.state_slot)


def run_group(runner: ModelRunner, insts: list[TaskInstance], encode, decode, arm: str
              ) -> list[str]:
    """Context prefill -> intervention -> question prefill -> greedy decode to a newline."""
    spec = TASKS[insts[0].task]
    page = runner.rc.page_size
    seqs, free = [], list(range(runner.rc.num_pages))
    for i, inst in enumerate(insts):
        ctx, question = encode(inst.context), encode(inst.question)
        pages = [free.pop() for _ in range(-(-(len(ctx) + len(question) + spec.max_new_tokens)
                                             // page))]
        seqs.append((SeqInput(ctx, 0, pages, i + 1), question))
    runner.forward([s for s, _ in seqs])
    steps, contexts = [], []
    for s, question in seqs:
        contexts.append(s.token_ids)
        s.prefix_len, s.token_ids = len(s.token_ids), question
        steps.append(s)
    apply_arm(runner, steps, arm, contexts)
    outputs = decode_until(runner, steps, runner.forward(steps), spec.max_new_tokens, {NEWLINE})
    return [decode(o) for o in outputs]


def evaluate(runner: ModelRunner, tasks: list[str], lengths: list[int], n: int, seed: int,
             arm: str, batch: int, tokenizer) -> list[Result]:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    results = []
    for length in lengths:
        for task in tasks:
            insts = make_instances(task, length, n, seed)
            scores = []
            for start in range(0, n, batch):
                group = insts[start : start + batch]
                texts = run_group(runner, group, encode, decode, arm)
                scores += [score_instance(inst, t) for inst, t in zip(group, texts)]
            results.append(Result(arm, task, length, sum(scores) / len(scores), len(scores)))
            if is_first_rank():  # progress on stderr; stdout stays the table / JSON lines
                print(f"[dasc-eval] {arm} {task} {length}: {results[-1].accuracy:.2f} "
                      f"({len(results)} done)", file=sys.stderr, flush=True)
    return results


def markdown_table(results: list[Result], tasks: list[str]) -> str:
    """Rows in the shape of the paper's Table 2: arm, length, one column per subtask, average."""
    head = "| Arm | Len | " + " | ".join(t.upper() for t in tasks) + " | Avg |"
    lines = [head, "|" + "---|" * (len(tasks) + 3)]
    keys = sorted({(r.arm, r.length) for r in results}, key=lambda k: (k[0] != "dense", k))
    for arm, length in keys:
        acc = {r.task: r.accuracy for r in results if r.arm == arm and r.length == length}
        cells = [f"{acc[t]:.2f}" for t in tasks]
        avg = sum(acc[t] for t in tasks) / len(tasks)
        lines.append(f"| {arm} | {length} | " + " | ".join(cells) + f" | {avg:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from model_runner.generate import DEFAULT_MODEL

    p = argparse.ArgumentParser(
        prog="dasc-eval", description="Per-subtask accuracy of a model on dasc's RULER-style task "
        "suite, answering each question on top of a cached context prefix.")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder (default: built-in)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--tasks", default="all", help=f"comma list from {','.join(TASKS)} or 'all'")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--n", type=int, default=10, help="instances per (task, length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 instances per task, shortest length")
    p.add_argument("--arms", nargs="+", default=["dense"],
                   help="dense | nr@W | wr@W | nr-int8@W | random@W | zero-full-kv | zero-linear | "
                        "zero-both (paper Table 1(a) interventions); default: dense")
    p.add_argument("--batch", type=int, default=8, help="instances per batch")
    p.add_argument("--json", action="store_true",
                   help="one JSON line per (arm, task, length) instead of a table")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.lengths = 3, [min(args.lengths)]
    args.task_list = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = [t for t in args.task_list if t not in TASKS]
    try:
        for arm in args.arms:
            parse_arm(arm)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if unknown or args.n < 1:
        print(f"error: unknown task {unknown[0]!r}" if unknown else "error: --n must be >= 1",
              file=sys.stderr)
        return 2
    if args.tp > 1 and not is_rank_process():
        return relaunch(args.tp, "loadgen.offline_eval",
                        argv if argv is not None else sys.argv[1:])
    try:
        results = run(args)
    except (ValueError, OSError, KeyError) as e:
        if is_first_rank():
            print(f"error: {e}", file=sys.stderr)
        return 1
    if is_first_rank():
        if args.json:
            for r in results:
                print(json.dumps({"arm": r.arm, "task": r.task, "length": r.length,
                                  "accuracy": r.accuracy, "n": r.n}))
        else:
            print(markdown_table(results, args.task_list))
    return 0


def run(args: argparse.Namespace) -> list[Result]:
    from transformers import AutoTokenizer

    from model_runner.parallel import init_tp_group, shutdown_tp_group
    from model_runner.runner import RunnerConfig

    tp = init_tp_group(torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    page = 16
    per_seq = -(-(max(args.lengths) + 64) // page)
    rc = RunnerConfig(str(Path(args.model)), dtype=args.dtype, num_pages=per_seq * args.batch,
                      page_size=page, num_state_slots=2 * args.batch + 1)  # + wr scratch
    runner = ModelRunner(rc, tp)
    results = []
    for arm in args.arms:
        prepare_arm(runner, arm, args.batch)
        results += evaluate(runner, args.task_list, args.lengths, args.n, args.seed, arm,
                            args.batch, tokenizer)
    shutdown_tp_group(tp)
    return results


if __name__ == "__main__":
    sys.exit(main())
