"""``dasc-bench``: serving experiments that start one dasc-serve per arm.

    dasc-bench matched-budget [--model DIR] [--tp T] (--budget-bytes B | --dense-slots S)
        [--wmax 16 64 128 512] [--placements off hybrid] [--policies nr wr] [--int8]
        [--seeds 42 123 7] [--out DIR]
    dasc-bench refresh-cost [--model DIR] [--tp T] [--checkpoint-slots N] [--wmax ...]
        [--seeds ...] [--out DIR]

Writes markdown, JSON and PNG plots into ``--out`` (with ``--save-requests`` also the timed
requests of every arm under ``--out/requests``).  ``--checkpoint-interval 0
--no-cache-finished`` checkpoints prompts only, as the paper's serving experiments do.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.compression.placement import PLACEMENTS
from model_runner.config import DEFAULT_MODEL
from scheduler.wire.serve_config import SchedulePolicyName


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model folder of every arm")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of every arm")
    p.add_argument("--wmax", type=float, nargs="+", default=[16.0, 64.0, 128.0, 512.0],
                   help="W_max of the dasc arms")
    p.add_argument("--int8", action="store_true", help="INT8 payload in every dasc arm")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 123, 7],
                   help="request-order seeds, paired across arms")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="folder for the markdown, JSON and plots")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--save-requests", action="store_true",
                   help="also write every timed request as JSON lines under --out/requests")
    g = p.add_argument_group("dasc-serve flags of every arm")
    g.add_argument("--checkpoint-interval", type=int, default=0,
                   help="a checkpoint every N prompt tokens (0: at the prompt end only)")
    g.add_argument("--no-cache-finished", action="store_true",
                   help="do not cache prompt + output when a request finishes")
    g.add_argument("--park-finished", action="store_true",
                   help="let a finished request's slot stay parked for its next turn "
                        "(dasc-serve's default); off here, so that every hit restores a "
                        "checkpoint of the arm's format, which is what these experiments measure")
    g.add_argument("--max-running-requests", type=int, default=32,
                   help="requests a server runs at once")
    g.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="new tokens per step, decodes included")
    g.add_argument("--schedule-policy", choices=list(SchedulePolicyName), default=None,
                   help="fcfs or lpm (default: dasc-serve's default)")
    g.add_argument("--schedule-max-passes", type=int, default=None,
                   help="lpm's fairness bound (default: dasc-serve's default)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dasc-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matched-budget", help="dense vs dasc arms at one state budget "
                       "(Figure 3(a-f), appendix C.2)", formatter_class=DefaultsHelpFormatter)
    _common(m)
    budget = m.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bytes", type=int, help="checkpoint bytes per rank")
    budget.add_argument("--dense-slots", type=int,
                        help="budget = this many physical dense slots per rank")
    m.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=["off", "hybrid"],
                   help="placements of the dasc arms")
    m.add_argument("--policies", nargs="+", choices=["nr", "wr"], default=["nr", "wr"],
                   help="refresh policies of the dasc arms")
    m.add_argument("--boundary-wmax", type=float, nargs="+", default=[16.0, 64.0, 128.0, 512.0],
                   help="capacity boundaries of the phase workload (the paper's four, whatever "
                   "arms run)")
    m.add_argument("--num-prompts", type=int, default=200, help="phase dataset size D")
    m.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    m.add_argument("--dense-replays", type=int, default=6,
                   help="timed replays of each dense-boundary block (paper: 6)")
    r = sub.add_parser("refresh-cost", help="dasc-wr minus dasc-nr TTFT at a fixed slot count "
                       "(Table 8)", formatter_class=DefaultsHelpFormatter)
    _common(r)
    r.add_argument("--checkpoint-slots", type=int, default=256, help="checkpoint slots per arm")
    r.add_argument("--placement", choices=PLACEMENTS, default="hybrid",
                   help="placement of the dasc arms")
    r.add_argument("--num-conversations", type=int, default=24, help="multi-turn conversations")
    r.add_argument("--num-turns", type=int, default=5, help="turns per conversation")
    r.add_argument("--context-len", type=int, default=512, help="tokens of the first prompt")
    r.add_argument("--turn-len", type=int, default=64, help="tokens added per turn")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["dasc-bench", *argv])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "matched-budget":
        from model_runner.bench import matched as experiment
    else:
        from model_runner.bench import refresh as experiment
    result = experiment.run(args)
    experiment.write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
