"""``dasc-bench matched-budget``: dense vs dasc arms at one per-rank state budget (paper sec. 5.3,
Figure 3(a-f), appendix C.2).

Every arm gets its own dasc-serve on the same budget and runs the same phase workload
(``loadgen.phases``, boundaries from the accounting, checked against each arm's live slot
count) with the same request-order seeds.  Ratios to dense are taken within each seed, then
averaged (mean +- sample SD over seeds), as the paper does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import httpx

from loadgen.bench.seed_metrics import (
    markdown_table,
    mean_sd,
    per_seed,
    pm,
    run_metrics,
    write_json,
)
from loadgen.phases import Phase, phase_dataset, plan_phases, run_phases
from loadgen.spawn import running_server
from loadgen.stream import make_client
from model_runner.bench.serving_arms import Arm, SlotPlanner, check_live_slots

PAPER_CAPACITY = 2.63  # Kimi-KDA complete-checkpoint capacity ratio the paper's targets use
PAPER_TTFT_REDUCTION, PAPER_THROUGHPUT_GAIN = 42.6, 68.4  # percent, Figure 3


def server_flags(args: argparse.Namespace, arm: Arm, size_flags: list[str], max_slots: int,
                 max_prompt_len: int) -> list[str]:
    # The KV pool holds every checkpointed prompt and every running one, so KV eviction never
    # caps the hit rate below what the checkpoint slots allow.
    kv_rows = max(65536, 2 * (max_slots + args.max_running_requests) * (max_prompt_len + 8))
    flags = ["--model", str(args.model), "--tp", str(args.tp), *size_flags,
             "--checkpoint-interval", str(args.checkpoint_interval),
             "--max-running-requests", str(args.max_running_requests),
             "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--max-total-tokens", str(kv_rows), *arm.server_flags()]
    for flag in ("--schedule-policy", "--schedule-max-passes"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        flags += [] if value is None else [flag, str(value)]
    flags += [] if args.park_finished else ["--no-park-finished"]
    return flags + (["--no-cache-finished"] if args.no_cache_finished else [])


def arms_of(args: argparse.Namespace) -> list[Arm]:
    return [Arm(0)] + [Arm(w, p, pol, args.int8) for w in args.wmax for p in args.placements
                       for pol in args.policies]


def run(args: argparse.Namespace) -> dict:
    planner = SlotPlanner(args.model, args.tp, args.budget_bytes, args.dense_slots)
    boundaries = planner.boundaries(args.boundary_wmax, args.int8)
    phases = plan_phases(boundaries, args.num_prompts, args.dense_replays)
    dataset = phase_dataset(args.num_prompts, args.prompt_len, (0, planner.cfg.vocab_size),
                            args.dataset_seed)
    arms = arms_of(args)
    expected = {a: planner.slots(a) for a in arms}
    size = ["--state-budget-bytes", str(planner.budget_bytes)]
    if args.save_requests:
        (args.out / "requests").mkdir(parents=True, exist_ok=True)
    results = []
    for arm in arms:
        flags = server_flags(args, arm, size, max(expected.values()), args.prompt_len)
        results.append(run_arm(args, arm, flags, expected[arm], phases, dataset))
    return {"command": args.command_line,
            "budget_bytes_per_rank": planner.budget_bytes, "boundaries": boundaries,
            "phases": [_phase_dict(p) for p in phases],
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                       if k != "func"},
            "arms": results}


def _phase_dict(p: Phase) -> dict:
    return {"name": p.name, "slots": p.slots, "block_len": p.block_len,
            "num_blocks": p.num_blocks, "num_replays": p.num_replays}


def run_arm(args: argparse.Namespace, arm: Arm, flags: list[str], expected_slots: int,
            phases: list[Phase], dataset: list[list[int]]) -> dict:
    started = time.monotonic()
    with running_server(*flags) as server:
        info = httpx.get(f"{server.base_url}/server_info", timeout=60).json()
        check_live_slots(arm, info, expected_slots)
        per_seed = {}
        path = args.out / "requests" / (arm.name.replace(" ", "_").replace("=", "") + ".jsonl")
        with path.open("w") if args.save_requests else contextlib.nullcontext() as f:
            for seed in args.seeds:
                run = asyncio.run(_phases(server.base_url, args, phases, dataset, seed))
                deltas = [t.get("delta") for t in run.telemetry if t["step"] == "replay"]
                m = run_metrics(run.results, run.replay_s, deltas)
                m["phases"] = run.phase_summaries
                per_seed[seed] = m
                for r in run.results if f is not None else []:
                    f.write(json.dumps({"arm": arm.name, **r.as_json()}) + "\n")
                print(f"[matched-budget] {arm.name:<24} seed {seed:<4} hit "
                      f"{m['cache_hit_rate']:.3f}  mean TTFT {m['mean_ttft_ms']:.1f} ms  "
                      f"input {m['input_throughput']:.0f} tok/s  failed {m['failed']}",
                      file=sys.stderr, flush=True)
    return {"arm": arm.name, "w_max": arm.w_max, "placement": arm.placement,
            "policy": arm.policy, "int8": arm.int8, "slots": info["num_checkpoint_slots"],
            "slot_bytes": info["checkpoint_bytes_per_slot"],
            "capacity_ratio": info["dense_bytes_per_slot"] / info["checkpoint_bytes_per_slot"],
            "wall_s": time.monotonic() - started, "seeds": per_seed}


async def _phases(base_url: str, args: argparse.Namespace, phases: list[Phase],
                  dataset: list[list[int]], seed: int):
    async with make_client(base_url, args.concurrency) as client:
        return await run_phases(client, phases, dataset, seed, args.concurrency,
                                show_progress=not args.no_progress)


def add_ratios(result: dict) -> None:
    """Per arm and seed: TTFT and input-throughput ratios to the dense arm of that seed."""
    dense = next(a for a in result["arms"] if a["w_max"] == 0)
    for arm in result["arms"]:
        for seed, m in arm["seeds"].items():
            d = dense["seeds"][seed]
            m["ttft_ratio"] = m["mean_ttft_ms"] / d["mean_ttft_ms"]
            m["throughput_ratio"] = m["input_throughput"] / d["input_throughput"]


def markdown(result: dict) -> str:
    header = ["arm", "slots", "capacity", "hit rate", "mean TTFT (ms)", "p90 TTFT (ms)",
              "input tok/s", "TTFT / dense", "throughput / dense", "TTFT hit / miss (ms)"]
    rows = []
    for a in result["arms"]:
        s = a["seeds"]
        rows.append([a["arm"], str(a["slots"]), f"{a['capacity_ratio']:.2f}×",
                     pm(per_seed(s, "cache_hit_rate"), 3), pm(per_seed(s, "mean_ttft_ms")),
                     pm(per_seed(s, "p90_ttft_ms")), pm(per_seed(s, "input_throughput"), 0),
                     pm(per_seed(s, "ttft_ratio"), 3), pm(per_seed(s, "throughput_ratio"), 3),
                     f"{pm(per_seed(s, 'mean_ttft_hit_ms'), 0)} / "
                     f"{pm(per_seed(s, 'mean_ttft_miss_ms'), 0)}"])
    seeds = ", ".join(str(s) for s in result["config"]["seeds"])
    phases = ", ".join(f"{p['name']} {p['num_blocks']}×{p['block_len']} prompts"
                       + ("" if p["num_replays"] == 1 else f" ({p['num_replays']} replays)")
                       for p in result["phases"])
    out = [f"Budget {result['budget_bytes_per_rank']:,} bytes per rank; seeds {seeds}; "
           f"mean ± SD over seeds, ratios within seed.", "", f"Phases: {phases}.", "",
           markdown_table(header, rows), "", _target_line(result), "", phase_table(result)]
    return "\n".join(out) + "\n"


def _target_line(result: dict) -> str:
    dasc = [a for a in result["arms"] if a["w_max"] and a["policy"] == "nr"]
    if not dasc:
        return ""
    best = min(dasc, key=lambda a: abs(a["capacity_ratio"] - PAPER_CAPACITY))
    ttft, _ = mean_sd([m["ttft_ratio"] for m in best["seeds"].values()])
    thr, _ = mean_sd([m["throughput_ratio"] for m in best["seeds"].values()])
    return (f"Target arm (capacity closest to the paper's {PAPER_CAPACITY}×): {best['arm']} "
            f"({best['capacity_ratio']:.2f}×): mean TTFT {100 * (1 - ttft):.1f} % lower "
            f"(paper {PAPER_TTFT_REDUCTION} %), input throughput {100 * (thr - 1):.1f} % higher "
            f"(paper {PAPER_THROUGHPUT_GAIN} %).")


def phase_table(result: dict) -> str:
    names = [p["name"] for p in result["phases"]]
    rows = []
    for a in result["arms"]:
        cells = [a["arm"]]
        for i in range(len(names)):
            hit = [m["phases"][i]["cache_hit_rate"] for m in a["seeds"].values()]
            ttft = [m["phases"][i]["mean_ttft_ms"] for m in a["seeds"].values()]
            cells.append(f"{mean_sd(hit)[0]:.3f} / {mean_sd(ttft)[0]:.0f}")
        rows.append(cells)
    return ("Per phase, mean over seeds: hit rate / mean TTFT (ms)\n\n"
            + markdown_table(["arm", *names], rows))


def write_outputs(result: dict, out: Path) -> None:
    from loadgen.bench.plots import plot_matched

    add_ratios(result)
    write_json(out / "matched-budget.json", result)
    md = f"# Matched-budget serving\n\n```\n{result['command']}\n```\n\n{markdown(result)}"
    (out / "matched-budget.md").write_text(md)
    plot_matched(result, out / "matched-budget.png")
    print(md)
