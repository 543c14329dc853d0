"""``dasc-loadgen``: TTFT / throughput / cache-hit load generator for any OpenAI-compatible
streaming server (dasc-serve, SGLang, vLLM).

    dasc-loadgen --base-url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-groups 8 --prompts-per-group 16 --prefix-len 1024 --suffix-len 64 \\
        --concurrency 16 --seed 0 --output run.jsonl

Every request streams ``/v1/completions`` with ``stream_options.include_usage``; prompts are
token ids (``--token-range``, default the vocabulary from dasc's ``/server_info``).  Progress on
stderr, a summary table on stdout, and with ``--output`` one JSON line per request, per phase
telemetry (``{"telemetry": ...}``) and ``{"summary": {...}}`` last.  Failed requests are
counted, their errors listed, and never enter the latency statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

import aiohttp

from client.cli_help import DefaultsHelpFormatter
from loadgen.phases import phase_dataset, plan_phases, run_phases
from loadgen.sender import Progress, run_sequential, run_window
from loadgen.stream import ServerAdmin, make_client, url_path
from loadgen.summary import format_table, summarize
from loadgen.workload import (
    PromptFileError,
    multi_turn,
    read_prompt_file,
    shared_prefix,
)

WORKLOADS = ("shared-prefix", "phases", "multi-turn", "file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dasc-loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="model name sent in each request (default: not sent)")
    p.add_argument("--api-key", default=None,
                   help="sent as a bearer token (default: no Authorization header)")
    p.add_argument("--workload", choices=WORKLOADS, required=True, help="what to send")
    g = p.add_argument_group("shared-prefix (groups x prompts) / multi-turn (conversations x "
                             "turns; prefix = context, suffix = tokens added per turn)")
    g.add_argument("--num-groups", type=int, default=8, help="groups / conversations")
    g.add_argument("--prompts-per-group", type=int, default=8, help="prompts / turns of each")
    g.add_argument("--prefix-len", type=int, default=512, help="tokens of the shared prefix")
    g.add_argument("--suffix-len", type=int, default=32, help="tokens after the prefix")
    g.add_argument("--system-len", type=int, default=0,
                   help="multi-turn: tokens of one system prompt before every conversation "
                        "(shared by all, as an agent's instructions are)")
    g.add_argument("--with-replies", action="store_true",
                   help="multi-turn: each turn resends the previous turn's reply (its token ids, "
                        "asked for with return_token_ids) before its new tokens, as a chat "
                        "client does (default: only the previous prompt)")
    g = p.add_argument_group("phases (paper appendix C.2)")
    g.add_argument("--num-prompts", type=int, default=256, help="dataset size D")
    g.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    g.add_argument("--boundary-slots", type=int, nargs="+", default=None, metavar="N",
                   help="checkpoint slots of each capacity boundary, the dense one first "
                   "(default: the server's live num_checkpoint_slots)")
    g.add_argument("--dense-replays", type=int, default=6,
                   help="timed replays of each dense-boundary block")
    g.add_argument("--dataset-seed", type=int, default=0,
                   help="seed of the prompts (phases, multi-turn); --seed orders requests")
    g = p.add_argument_group("file")
    g.add_argument("--prompt-file", type=Path, default=None,
                   help='JSON lines {"prompt": text|[ids], "max_tokens"?, "warmup"?} '
                   "(default: none; --workload file needs it)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the request order, the arrivals "
                   "and the shared-prefix prompts")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens to generate per request")
    p.add_argument("--token-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI) (default: the server's "
                   "vocabulary from /server_info)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output", type=Path, default=None,
                   help="JSON lines file (default: none, the table only)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


async def check_reachable(client: aiohttp.ClientSession, base_url: str) -> None:
    """One GET before anything else: a wrong URL or a server that is down becomes one error
    that names the URL, not a failure of every request.  Any HTTP answer will do."""
    try:
        async with client.get(url_path("/v1/models")) as r:
            await r.read()
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
        raise ConnectionError(f"cannot reach {base_url}: {e or type(e).__name__}") from None


async def token_range(args: argparse.Namespace, admin: ServerAdmin) -> tuple[int, int]:
    if args.token_range is not None:
        lo, hi = args.token_range
        if not 0 <= lo < hi:
            raise ValueError("--token-range needs 0 <= LO < HI")
        return lo, hi
    info = await admin.server_info()
    if not info or "vocab_size" not in info:
        raise ValueError("the server reports no vocab_size (/server_info): give --token-range")
    return 0, int(info["vocab_size"])


async def run(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """(JSON lines, summary) of one load-generator run."""
    async with make_client(args.base_url, args.concurrency, args.api_key, args.timeout) as client:
        await check_reachable(client, args.base_url)
        admin = ServerAdmin(client)
        if args.workload == "phases":
            return await _run_phases(args, client, admin)
        if args.workload == "file":
            requests = read_prompt_file(args.prompt_file, args.max_tokens)
        else:
            tr = await token_range(args, admin)
            if args.workload == "shared-prefix":
                requests = shared_prefix(args.num_groups, args.prompts_per_group,
                                         args.prefix_len, args.suffix_len, tr, args.seed,
                                         args.max_tokens)
            else:
                requests = multi_turn(args.num_groups, args.prompts_per_group, args.prefix_len,
                                      args.suffix_len, tr, args.seed, args.max_tokens,
                                      args.dataset_seed, args.with_replies, args.system_len)
        warm = [r for r in requests if r.is_warmup]
        timed = [r for r in requests if not r.is_warmup]
        lines = [{**r.as_json(), "warmup": True}
                 for r in await run_sequential(client, warm, args.model)]
        progress = Progress(len(timed), args.workload, not args.no_progress)
        try:
            win = await run_window(client, timed, args.concurrency, args.model,
                                   args.request_rate, args.seed, progress)
        finally:
            progress.close()
        lines += [r.as_json() for r in win.results]
        summary = summarize(win.results, win.duration)
        summary["num_warmup"] = len(warm)
        summary["num_warmup_failed"] = sum(1 for line in lines if line.get("warmup")
                                           and line["error"])
        return lines, summary


async def _run_phases(args: argparse.Namespace, client: aiohttp.ClientSession,
                      admin: ServerAdmin) -> tuple[list[dict], dict]:
    slots = args.boundary_slots
    if slots is None:
        info = await admin.server_info()
        if not info or "num_checkpoint_slots" not in info:
            raise ValueError("the server reports no num_checkpoint_slots: give --boundary-slots")
        slots = [int(info["num_checkpoint_slots"])]
    names = ["dense"] + [f"boundary{i}" for i in range(1, len(slots))]
    phases = plan_phases(list(zip(names, slots)), args.num_prompts, args.dense_replays)
    dataset = phase_dataset(args.num_prompts, args.prompt_len, await token_range(args, admin),
                            args.dataset_seed)
    run = await run_phases(client, phases, dataset, args.seed, args.concurrency, args.model,
                           args.max_tokens, not args.no_progress)
    lines = [r.as_json() for r in run.results] + [{"telemetry": t} for t in run.telemetry]
    summary = summarize(run.results, run.replay_s)
    summary["phases"] = run.phase_summaries
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload == "file" and args.prompt_file is None:
        print("dasc-loadgen: error: --workload file needs --prompt-file", file=sys.stderr)
        return 2
    for flag, value, low in (("--concurrency", args.concurrency, 1),
                             ("--num-groups", args.num_groups, 1),
                             ("--prompts-per-group", args.prompts_per_group, 1),
                             ("--prefix-len", args.prefix_len, 0),
                             ("--suffix-len", args.suffix_len, 0),
                             ("--system-len", args.system_len, 0),
                             ("--max-tokens", args.max_tokens, 0)):
        if value < low:  # an empty workload would "succeed" with no request sent
            print(f"dasc-loadgen: error: {flag} must be at least {low} (got {value})",
                  file=sys.stderr)
            return 2
    if args.system_len and args.workload != "multi-turn":
        print("dasc-loadgen: error: --system-len needs --workload multi-turn", file=sys.stderr)
        return 2
    if args.with_replies and args.workload != "multi-turn":
        print("dasc-loadgen: error: --with-replies needs --workload multi-turn", file=sys.stderr)
        return 2
    try:
        lines, summary = asyncio.run(run(args))
    except (PromptFileError, ValueError, RuntimeError, aiohttp.ClientError, OSError) as e:
        print(f"dasc-loadgen: error: {e}", file=sys.stderr)
        return 1
    print(format_table(summary, f"dasc-loadgen {args.workload}"))
    for p in summary.get("phases", []):
        hit, ttft = p["cache_hit_rate"], p["mean_ttft_ms"]
        print(f"  phase {p['phase']:<10} Q={p['block_len']:<5} blocks={p['num_blocks']:<3} "
              f"replays={p['num_replays']}  hit={'-' if hit is None else f'{hit:.3f}'}  "
              f"mean TTFT={'-' if ttft is None else f'{ttft:.1f}'} ms  failed={p['failed']}")
    if summary.get("num_warmup"):
        print(f"  warm-up requests (untimed): {summary['num_warmup']}, "
              f"failed {summary['num_warmup_failed']}")
    if args.output is not None:
        with args.output.open("w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
            f.write(json.dumps({"summary": summary}) + "\n")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
