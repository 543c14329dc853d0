"""Parked slots on a chat-style multi-turn load: each turn resends the previous turn's prompt and
reply before its new tokens (``dasc-loadgen --workload multi-turn --with-replies``), so it hits
at everything the previous turn processed, where that turn's slot is parked.  Per active-slot
count, three servers: dasc-nr and dasc-wr with ``--no-park-finished`` (every hit loads a
checkpoint), then dasc-wr with parking (the default).

    python -m loadgen.bench.chat_parking [--wmax 128] [--max-running-requests 32 16] \\
        [--conversations 24] [--turns 5] [--context 512] [--turn-len 64] [--max-tokens 8] \\
        [--concurrency 32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from loadgen.bench.seed_metrics import markdown_table
from loadgen.sender import run_window
from loadgen.spawn import running_server
from loadgen.stream import make_client
from loadgen.summary import summarize
from loadgen.workload import Request, multi_turn
from model_runner.config import DEFAULT_MODEL, ModelConfig

ARMS = [("nr, not parked", ["--load-policy", "nr", "--no-park-finished"]),
        ("wr, not parked", ["--load-policy", "wr", "--no-park-finished"]),
        ("wr, parked (default)", ["--load-policy", "wr"])]
COUNTERS = ("parked_hits", "loads_nr", "loads_wr", "refresh_tokens")


def run_one(args: argparse.Namespace, requests: list[Request], running: int, name: str,
            flags: list[str]) -> dict:
    serve = ["--model", str(args.model), "--wmax", f"{args.wmax:g}", "--checkpoint-interval",
             "256", "--max-running-requests", str(running), *flags]
    with running_server(*serve) as server:

        async def go():
            async with make_client(server.base_url, args.concurrency) as client:
                return await run_window(client, requests, args.concurrency)

        win = asyncio.run(go())
        counters = server.stats()["counters"]
    summary = summarize(win.results, win.duration)
    row = {"max_running_requests": running, "arm": name, "dasc_serve_flags": serve,
           "hit": summary["cache_hit_rate"], "mean_ttft_ms": summary["mean_ttft_ms"],
           "mean_tpot_ms": summary.get("mean_tpot_ms"), "duration_s": summary["duration"],
           "failed": summary["failed"], **{k: counters[k] for k in COUNTERS}}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    header = ["active slots", "arm", "hit rate", "mean TTFT (ms)", "mean TPOT (ms)",
              "parked hits", "checkpoint loads", "failed"]
    return markdown_table(header, [
        [str(r["max_running_requests"]), r["arm"], f"{r['hit']:.3f}",
         f"{r['mean_ttft_ms']:.1f}", f"{r['mean_tpot_ms']:.1f}", str(r["parked_hits"]),
         str(r["loads_nr"] + r["loads_wr"]), str(r["failed"])] for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.bench.chat_parking",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model folder")
    p.add_argument("--wmax", type=float, default=128.0, help="W_max of every server")
    p.add_argument("--max-running-requests", type=int, nargs="+", default=[32, 16],
                   help="active slots: one set of three servers each")
    p.add_argument("--conversations", type=int, default=24, help="conversations")
    p.add_argument("--turns", type=int, default=5, help="turns of each")
    p.add_argument("--context", type=int, default=512, help="tokens before the first turn")
    p.add_argument("--turn-len", type=int, default=64, help="new tokens a turn")
    p.add_argument("--max-tokens", type=int, default=8, help="reply tokens a turn")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=42, help="order of the conversations")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file of the rows (default: the table only)")
    args = p.parse_args(argv)
    # the prompts dasc-loadgen --workload multi-turn --with-replies sends (its default range)
    requests = multi_turn(args.conversations, args.turns, args.context, args.turn_len,
                          (0, ModelConfig.from_dir(args.model).vocab_size), args.seed,
                          args.max_tokens, with_replies=True)
    rows = [run_one(args, requests, running, name, flags)
            for running in args.max_running_requests for name, flags in ARMS]
    print(markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
