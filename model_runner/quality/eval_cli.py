"""``dasc-eval``: task-suite accuracy and logit fidelity through dasc's runner, with the
cached-prefix protocol.

Per instance: prefill the context (the cacheable prefix), apply the arm's transformation to
what the cache would hold (``model_runner.quality.arms``), then answer the question on top: greedy
decoding to a newline for accuracy, and teacher forcing of question + gold completion for the
mean KL of the next-token distributions from the dense arm's and the suffix's Δ NLL
(``model_runner.quality.fidelity``).  Each context is prefilled once for all arms
(``model_runner.quality.sweep``); results are JSON lines (``model_runner.quality.results``).  Arms
given as a bare kind (``nr wr nr-int8 random``) run at every ``--w-max``; random arms once per
``--mask-seeds``.
``--out FILE`` appends JSON lines and skips what the file already holds, so an interrupted run
continues where it stopped.  Every TP rank runs the same loop and rank 0 prints.

Subcommands: ``dasc-eval report`` (tables and a plot from JSON lines,
``model_runner.quality.report``)
and ``dasc-eval study`` (the whole quality study, ``model_runner.quality.study``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from client.cli_help import DefaultsHelpFormatter
from model_runner.processes import is_first_rank, is_rank_process, relaunch
from model_runner.quality.arms import (
    RANDOM_SEED,
    expand_arms,
)
from model_runner.quality.results import appender, load_results, markdown_table
from model_runner.quality.sweep import Result, sweep
from model_runner.quality.tasks import LENGTHS, TASKS


def build_parser() -> argparse.ArgumentParser:
    from model_runner.config import DEFAULT_MODEL

    p = argparse.ArgumentParser(
        prog="dasc-eval", description="Per-subtask accuracy and logit fidelity (mean KL vs "
        "dense, delta NLL) of a model on dasc's RULER-style task suite, answering each question "
        "on top of a cached context prefix.  Subcommands: 'dasc-eval report -h', "
        "'dasc-eval study -h'.", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="model folder (default: the built-in tiny Kimi-Linear model, "
                        "%(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--tasks", default="all", help=f"comma list from {','.join(TASKS)} or 'all'")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                   help="context lengths in tokens")
    p.add_argument("--n", type=int, default=10, help="instances per (task, length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the instances")
    p.add_argument("--quick", action="store_true", help="3 instances per task, shortest length")
    p.add_argument("--arms", nargs="+", default=["dense"],
                   help="dense | nr@W | wr@W | nr-int8@W | random@W | zero-full-kv | zero-linear | "
                        "zero-both (paper Table 1(a) interventions) | a bare nr, wr, nr-int8 or "
                        "random (run at every --w-max)")
    p.add_argument("--w-max", type=float, nargs="+", default=None,
                   help="W_max values for arms given as a bare kind (default: none; a bare kind "
                        "then is an error)")
    p.add_argument("--mask-seeds", type=int, nargs="+", default=[RANDOM_SEED],
                   help="one count-matched random plan per seed (paper: 1234 2027 3407 4519 5683)")
    p.add_argument("--batch", type=int, default=8, help="instances per batch")
    p.add_argument("--json", action="store_true",
                   help="one JSON line per (arm, task, length) instead of a table")
    p.add_argument("--out", help="append JSON lines to this file and skip (arm, task, length) "
                   "units it already holds (resumable; default: no file)")
    p.add_argument("--decode-all", action="store_true",
                   help="decode every instance (default: skip greedy decoding where the "
                        "teacher-forced argmax path already is the gold completion)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations")
    p.add_argument("--base-url", default=None,
                   help="evaluate through a running dasc-serve instead (warm-then-replay; the "
                        "arm is the server's; --model names the tokenizer folder; default: "
                        "in-process)")
    p.add_argument("--api-key", default=None,
                   help="with --base-url: the server's API key (default: none)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="with --base-url: instances in flight")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.n, args.lengths = 3, [min(args.lengths)]
    args.task_list = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw and raw[0] in ("report", "study"):
        if raw[0] == "report":
            from model_runner.quality.report import main as sub
        else:
            from model_runner.quality.study import main as sub
        return sub(raw[1:])
    args = parse_args(argv)
    unknown = [t for t in args.task_list if t not in TASKS]
    try:
        args.arm_list = expand_arms(args.arms, args.w_max or [], args.mask_seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if unknown or args.n < 1:
        print(f"error: unknown task {unknown[0]!r}" if unknown else "error: --n must be >= 1",
              file=sys.stderr)
        return 2
    if args.base_url:
        return main_served(args)
    if args.tp > 1 and not is_rank_process():
        return relaunch(args.tp, "model_runner.quality.eval_cli", raw)
    try:
        results = run(args)
    except (ValueError, OSError, KeyError) as e:
        if is_first_rank():
            print(f"error: {e}", file=sys.stderr)
        return 1
    if is_first_rank():
        order = {a.label: i for i, a in enumerate(args.arm_list)}
        results.sort(key=lambda r: order[r.label])  # arm-major, as the arms were given
        if args.json:
            for r in results:
                print(json.dumps(r.to_json()))
        elif results:
            print(markdown_table(results, args.task_list))
    return 0


def main_served(args: argparse.Namespace) -> int:
    import httpx

    from model_runner.quality.served import print_json, run_served

    try:
        results, loaded = run_served(args)
    except (httpx.HTTPError, OSError, ValueError) as e:
        print(f"error: {args.base_url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print_json(results, loaded)
    else:
        print(markdown_table(results, args.task_list))
        worst = min(loaded.values())
        print(f"\nquestions that hit their warm context: {worst:.2f} at worst")
    return 0


def run(args: argparse.Namespace) -> list[Result]:
    from transformers import AutoTokenizer

    from model_runner.parallel import init_tp_group, shutdown_tp_group
    from model_runner.runner import ModelRunner, RunnerConfig

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tp = init_tp_group(torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    page = 16
    per_seq = -(-(max(args.lengths) + 64) // page)
    rc = RunnerConfig(str(Path(args.model)), dtype=args.dtype, num_pages=per_seq * args.batch,
                      page_size=page, num_state_slots=2 * args.batch + 1)  # + wr scratch
    runner = ModelRunner(rc, tp)
    model = Path(args.model).name
    done = frozenset(r.key() for r in load_results(args.out)) if args.out else frozenset()
    emit = appender(args.out) if args.out else None
    results = sweep(runner, model, args.task_list, args.lengths, args.n, args.seed,
                    args.arm_list, args.batch, tokenizer, done, emit, args.decode_all)
    shutdown_tp_group(tp)
    return results


if __name__ == "__main__":
    sys.exit(main())
