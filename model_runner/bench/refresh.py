"""``dasc-bench refresh-cost``: what dasc-wr's suffix refresh costs per hit (paper Table 8).

Every arm has the same fixed number of checkpoint slots (``--checkpoint-slots``), so nr and wr
differ only in the refresh.  All arms replay one multi-turn workload (turn k extends turn k-1,
so turn k hits turn k-1's prompt-end checkpoint) with the same request-order seeds; the cache is
flushed before each seed.  Per seed: dTTFT = mean TTFT(wr) - mean TTFT(nr), and cost per hit =
dTTFT x requests / hits(wr), the average latency of one reconstruction event; replayed tokens
per hit come from the server's counters (refresh_tokens / loads_wr).  Beside it, the rank
compute a refresh adds per hit: (compute_s(wr) - compute_s(nr)) / hits(wr).  In a closed loop
with C requests in flight, mean TTFT is about C times the time per request (Little's law), so the
latency cost per hit is about C times the compute per hit, and so is its noise.

The nr and wr servers of a W_max run side by side (the idle one waits on a socket) and each seed
runs on both back to back, in alternating order, so the drift of a shared machine hits both arms
alike instead of landing between them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import ExitStack
from pathlib import Path

from loadgen.bench.seed_metrics import markdown_table, per_seed, pm, run_metrics, write_json
from loadgen.sender import Progress, run_window
from loadgen.spawn import running_server
from loadgen.stream import ServerAdmin, make_client
from loadgen.workload import multi_turn
from model_runner.bench.matched import server_flags
from model_runner.bench.serving_arms import Arm
from model_runner.config import ModelConfig

PAPER_TABLE8 = {16: (61.8, 67.0), 64: (78.9, 85.5), 128: (100.0, 108.4), 512: (230.5, 249.3),
                1024: (393.3, 426.0)}  # W_max: (dTTFT ms, cost per hit ms), Kimi-KDA, 899 slots


def run(args: argparse.Namespace) -> dict:
    vocab = ModelConfig.from_dir(args.model).vocab_size
    max_len = args.context_len + args.num_turns * args.turn_len
    size = ["--checkpoint-slots", str(args.checkpoint_slots)]
    arms: dict[tuple[float, str], dict[int, dict]] = {}
    for w in args.wmax:
        pair = {policy: Arm(w, args.placement, policy, args.int8) for policy in ("nr", "wr")}
        with ExitStack() as stack:
            servers = {policy: stack.enter_context(running_server(
                *server_flags(args, arm, size, args.checkpoint_slots, max_len)))
                for policy, arm in pair.items()}
            for i, seed in enumerate(args.seeds):
                requests = multi_turn(args.num_conversations, args.num_turns, args.context_len,
                                      args.turn_len, (0, vocab), seed,
                                      dataset_seed=args.dataset_seed)
                for policy in ("nr", "wr") if i % 2 == 0 else ("wr", "nr"):
                    m = asyncio.run(_one(servers[policy].base_url, requests, args))
                    arms.setdefault((w, policy), {})[seed] = m
                    print(f"[refresh-cost] {pair[policy].name:<24} seed {seed:<4} hit "
                          f"{m['cache_hit_rate']:.3f}  mean TTFT {m['mean_ttft_ms']:.1f} ms  "
                          f"failed {m['failed']}", file=sys.stderr, flush=True)
    rows = [cost_row(w, arms[(w, "nr")], arms[(w, "wr")], args.seeds) for w in args.wmax]
    return {"command": args.command_line,
            "config": {k: str(v) for k, v in vars(args).items() if k != "func"}, "rows": rows}


def cost_row(w_max: float, nr: dict[int, dict], wr: dict[int, dict], seeds: list[int]) -> dict:
    """One W_max's figures from each seed's metrics of the two arms: the latency cost per hit
    (the paper's) and the rank compute the refresh adds per hit (the server's ``compute_s``)."""
    delta = [wr[s]["mean_ttft_ms"] - nr[s]["mean_ttft_ms"] for s in seeds]
    cost, compute = [], []
    for d, s in zip(delta, seeds):
        hits = wr[s]["num_hits"]
        extra = wr[s]["server"]["compute_s"] - nr[s]["server"]["compute_s"]
        cost.append(d * wr[s]["completed"] / hits if hits else None)
        compute.append(1000 * extra / hits if hits else None)
    loads = sum(wr[s]["server"]["loads_wr"] for s in seeds)
    replayed = sum(wr[s]["server"]["refresh_tokens"] for s in seeds)
    return {"w_max": w_max, "nr": nr, "wr": wr, "delta_ttft_ms": delta, "cost_per_hit_ms": cost,
            "compute_per_hit_ms": compute,
            "replay_tokens_per_hit": replayed / loads if loads else None}


async def _one(base_url: str, requests, args: argparse.Namespace) -> dict:
    async with make_client(base_url, args.concurrency) as client:
        admin = ServerAdmin(client)
        await admin.flush()
        before = await admin.stats()
        progress = Progress(len(requests), "refresh-cost", not args.no_progress)
        try:
            win = await run_window(client, requests, args.concurrency, progress=progress)
        finally:
            progress.close()
        after = await admin.stats()
    delta = {k: v - before["counters"].get(k, 0) for k, v in after["counters"].items()}
    for k in ("num_steps", "step_s", "compute_s"):
        delta[k] = after[k] - before[k]
    return run_metrics(win.results, win.duration, [delta])


def markdown(result: dict) -> str:
    header = ["W_max", "hit nr", "hit wr", "TTFT nr (ms)", "TTFT wr (ms)", "ΔTTFT (ms)",
              "replay tok/hit", "cost/hit (ms)", "rank compute/hit (ms)",
              "parked share of wr hits",
              "paper ΔTTFT / cost/hit (ms)"]
    rows = []
    for r in result["rows"]:
        paper = PAPER_TABLE8.get(int(r["w_max"]))
        tok = r["replay_tokens_per_hit"]
        nr, wr = r["nr"], r["wr"]
        hits = sum(m["num_hits"] for m in wr.values())
        parked = sum(m["server"].get("parked_hits", 0) for m in wr.values())
        rows.append([f"{r['w_max']:g}", pm(per_seed(nr, "cache_hit_rate"), 4),
                     pm(per_seed(wr, "cache_hit_rate"), 4), pm(per_seed(nr, "mean_ttft_ms")),
                     pm(per_seed(wr, "mean_ttft_ms")), pm(r["delta_ttft_ms"]),
                     "n/a" if tok is None else f"{tok:.1f}", pm(r["cost_per_hit_ms"]),
                     pm(r.get("compute_per_hit_ms", [])),
                     f"{parked / hits:.3f}" if hits else "n/a",
                     "—" if paper is None else f"{paper[0]} / {paper[1]}"])
    cfg = result["config"]
    parking = ("finished slots parked (a parked hit restores no checkpoint)"
               if cfg.get("park_finished") == "True" else "--no-park-finished")
    return (f"{parking}; {cfg['checkpoint_slots']} checkpoint slots in every arm; "
            f"{cfg['num_conversations']}"
            f" conversations × {cfg['num_turns']} turns (context {cfg['context_len']}, "
            f"+{cfg['turn_len']} tokens per turn); placement {cfg['placement']}; mean ± SD over "
            f"paired seeds {cfg['seeds']}.\n\n" + markdown_table(header, rows) + "\n")


def write_outputs(result: dict, out: Path) -> None:
    from loadgen.bench.plots import plot_refresh

    write_json(out / "refresh-cost.json", result)
    md = f"# Fixed-slot refresh cost\n\n```\n{result['command']}\n```\n\n{markdown(result)}"
    (out / "refresh-cost.md").write_text(md)
    plot_refresh(result["rows"], out / "refresh-cost.png")
    print(md)

