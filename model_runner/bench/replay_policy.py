"""Schedule policies on a concurrent workload with repeats: distinct prompts, each sent 1 + R times
in one seeded shuffled order, a closed loop of C requests in flight, prompt-end checkpoints
only, dense vs dasc-nr at one per-rank state budget.  Every (arm, policy) gets its own
dasc-serve; the policies of one arm run back to back, so their ratios share the machine's load.

    python -m model_runner.bench.replay_policy --tp 2 --dense-slots 16 --wmax 0 128 \\
        --policies fcfs lpm --num-prompts 48 --prompt-len 256 --replays 2 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from client.cli_help import DefaultsHelpFormatter
from loadgen.bench.seed_metrics import markdown_table, run_metrics
from loadgen.sender import run_window
from loadgen.spawn import running_server
from loadgen.stream import make_client
from loadgen.workload import Request, random_ids
from model_runner.bench.serving_arms import Arm, SlotPlanner
from model_runner.config import DEFAULT_MODEL
from scheduler.wire.serve_config import SchedulePolicyName


def replay_workload(num_prompts: int, prompt_len: int, replays: int, vocab: int, seed: int
                    ) -> list[Request]:
    rng = random.Random(seed)
    prompts = [random_ids(rng, prompt_len, (0, vocab)) for _ in range(num_prompts)]
    order = [i for i in range(num_prompts) for _ in range(1 + replays)]
    rng.shuffle(order)
    return [Request(prompts[i], 1, tags={"prompt": i}) for i in order]


def run_one(args: argparse.Namespace, arm: Arm, policy: str, budget: int,
            requests: list[Request]) -> dict:
    kv_rows = max(65536, 4 * len(requests) * (args.prompt_len + 8))
    flags = ["--model", str(args.model), "--tp", str(args.tp), "--state-budget-bytes",
             str(budget), "--checkpoint-interval", "0", "--no-cache-finished",
             "--max-running-requests", str(args.max_running_requests), "--chunked-prefill-size",
             str(args.chunked_prefill_size), "--max-total-tokens", str(kv_rows),
             "--schedule-policy", policy, *arm.server_flags()]
    started = time.monotonic()
    with running_server(*flags) as server:
        info = httpx.get(f"{server.base_url}/server_info", timeout=60).json()

        async def go():
            async with make_client(server.base_url, args.concurrency) as client:
                return await run_window(client, requests, args.concurrency)

        win = asyncio.run(go())
    m = run_metrics(win.results, win.duration, [])
    m.update(arm=arm.name, policy=policy, slots=info["num_checkpoint_slots"],
             wall_s=time.monotonic() - started)
    print(f"[replay-policy] {arm.name:<22} {policy:<5} hit {m['cache_hit_rate']:.3f}  mean TTFT "
          f"{m['mean_ttft_ms']:.1f} ms  input {m['input_throughput']:.0f} tok/s  failed "
          f"{m['failed']}", file=sys.stderr, flush=True)
    return m


def markdown(rows: list[dict]) -> str:
    base = {r["arm"]: r for r in rows if r["policy"] == rows[0]["policy"]}
    dense = {r["policy"]: r for r in rows if r["arm"] == "dense"}
    header = ["arm", "policy", "slots", "hit rate", "mean TTFT (ms)", "p90 TTFT (ms)",
              "TTFT hit / miss (ms)", "input tok/s", f"TTFT / {rows[0]['policy']}",
              "TTFT / dense (same policy)", "throughput / dense"]
    out = []
    for r in rows:
        d = dense.get(r["policy"])
        out.append([r["arm"], r["policy"], str(r["slots"]), f"{r['cache_hit_rate']:.3f}",
                    f"{r['mean_ttft_ms']:.1f}", f"{r['p90_ttft_ms']:.1f}",
                    f"{r['mean_ttft_hit_ms'] or 0:.0f} / {r['mean_ttft_miss_ms'] or 0:.0f}",
                    f"{r['input_throughput']:.0f}",
                    f"{r['mean_ttft_ms'] / base[r['arm']]['mean_ttft_ms']:.3f}",
                    f"{r['mean_ttft_ms'] / d['mean_ttft_ms']:.3f}" if d else "-",
                    f"{r['input_throughput'] / d['input_throughput']:.3f}" if d else "-"])
    return markdown_table(header, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_runner.bench.replay_policy",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model folder")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--dense-slots", type=int, default=16,
                   help="budget = this many physical dense slots per rank")
    p.add_argument("--wmax", type=float, nargs="+", default=[0.0, 128.0],
                   help="arms: 0 is dense, else dasc-nr hybrid at this W_max")
    p.add_argument("--policies", nargs="+", choices=list(SchedulePolicyName),
                   default=list(SchedulePolicyName),
                   help="schedule policies, run back to back per arm")
    p.add_argument("--num-prompts", type=int, default=48, help="distinct prompts")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    p.add_argument("--replays", type=int, default=2, help="repeats of each prompt")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-running-requests", type=int, default=32, help="server flag")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="server flag")
    p.add_argument("--seed", type=int, default=0, help="prompts and their order")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file of the rows (default: the table only)")
    args = p.parse_args(argv)
    planner = SlotPlanner(args.model, args.tp, dense_slots=args.dense_slots)
    requests = replay_workload(args.num_prompts, args.prompt_len, args.replays,
                               planner.cfg.vocab_size, args.seed)
    arms = [Arm(w, "hybrid" if w else "off") for w in args.wmax]
    rows = [run_one(args, arm, pol, planner.budget_bytes, requests)
            for arm in arms for pol in args.policies]
    print(markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
