"""``dasc-eval study``: the whole quality study in one resumable command.

For every model: ``dasc-eval`` with the arms dense, nr, wr, nr-int8 at every W_max and random at
every W_max and mask seed, appending to ``OUT_DIR/<model>.jsonl`` (an interrupted study continues
where it stopped); then ``dasc-eval report`` writes the tables (``--md``, default
``OUT_DIR/tables.md``) and the W_max plot (``--png``, default ``OUT_DIR/quality.png``).
Models run as separate single-threaded processes, ``--jobs`` at a time (the tiny models cannot
use more than one core per process well).  Progress goes to stderr.

    dasc-eval study --out-dir out/quality --n 16 --md docs/results/quality_tables.md \
        --png docs/results/quality.png              # the full study (docs/results/quality.md)
    dasc-eval study --out-dir /tmp/q --quick         # a smoke version of every arm and the report
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.quality.tasks import LENGTHS, TASKS

ASSETS = Path(__file__).resolve().parent.parent / "model_runner" / "assets"
MODELS = [str(ASSETS / "kimi-linear-tiny"), str(ASSETS / "qwen3-next-tiny")]
W_MAX = [16, 64, 128, 512, 1024]
MASK_SEEDS = [1234, 2027, 3407, 4519, 5683]  # the paper's
ARMS = ["dense", "nr", "wr", "nr-int8", "random"]
QUICK = {"tasks": "s1,vt", "n": 2, "lengths": [512], "w_max": [16, 1024],
         "mask_seeds": MASK_SEEDS[:2]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dasc-eval study", description="Quality under compression: "
                                "every arm on both models, then the report.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out-dir", required=True, help="one <model>.jsonl per model (resumable)")
    p.add_argument("--md", help="markdown tables (default: OUT_DIR/tables.md)")
    p.add_argument("--png", help="accuracy and KL vs W_max (default: OUT_DIR/quality.png)")
    p.add_argument("--models", nargs="+", default=MODELS, help="model folders")
    p.add_argument("--tasks", default="all", help=f"comma list from {','.join(TASKS)} or 'all'")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                   help="context lengths in tokens")
    p.add_argument("--n", type=int, default=16, help="instances per (task, length)")
    p.add_argument("--batch", type=int, default=8, help="instances per batch")
    p.add_argument("--w-max", type=float, nargs="+", default=W_MAX,
                   help="W_max of the compressed and random arms")
    p.add_argument("--mask-seeds", type=int, nargs="+", default=MASK_SEEDS,
                   help="one random plan per seed (the paper's five)")
    p.add_argument("--arms", nargs="+", default=ARMS, help="arm kinds, as dasc-eval --arms")
    p.add_argument("--jobs", type=int, default=2, help="models evaluated at once")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--quick", action="store_true",
                   help="smoke version: tasks s1,vt, 2 instances at 512, W_max 16 and 1024, "
                        "two mask seeds")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:  # the smoke settings become the defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


def eval_command(args: argparse.Namespace, model: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "model_runner.quality.eval_cli", "--model", model, "--tasks",
            args.tasks, "--lengths", *map(str, args.lengths), "--n", str(args.n), "--batch",
            str(args.batch), "--arms", *args.arms, "--w-max", *(f"{w:g}" for w in args.w_max),
            "--mask-seeds", *map(str, args.mask_seeds), "--threads", "1", "--json", "--out",
            str(out)]


def main(argv: list[str] | None = None) -> int:
    from model_runner.quality.report import main as report_main

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = [out_dir / f"{Path(m).name}.jsonl" for m in args.models]
    pending = list(zip(args.models, outputs))
    running: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failed = 0
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            model, out = pending.pop(0)
            print(f"[dasc-eval study] {Path(model).name} -> {out}", file=sys.stderr, flush=True)
            running.append(subprocess.Popen(eval_command(args, model, out), env=env,
                                            stdout=subprocess.DEVNULL))
        done = running.pop(0)
        failed += done.wait() != 0
    if failed:
        print(f"error: {failed} model run(s) failed; rerun to continue", file=sys.stderr)
        return 1
    return report_main([*map(str, outputs), "--md", args.md or str(out_dir / "tables.md"),
                        "--png", args.png or str(out_dir / "quality.png"), "--resamples",
                        str(args.resamples)])


if __name__ == "__main__":
    sys.exit(main())
