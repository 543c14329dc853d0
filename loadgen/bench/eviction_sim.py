"""Checkpoint admission and eviction (``--checkpoint-admission branch|all|reuse``,
``--checkpoint-eviction lru|reuse``) under state-pool pressure, without a model: the real
scheduler plans every step of a closed loop of C requests and stand-in ranks answer with seeded
tokens.  The hit rate (cached / prompt tokens) and the checkpoints stored depend only on the
order of admissions, stores and evictions, never on the model, so these are exactly the numbers
a server reports for the same arrival order; so do the prefill chunks the steps carry (a chunk
runs through the store points inside it, snapshotting the state at each).

    python -m loadgen.bench.eviction_sim --slots 8 16 32 --concurrency 8 --admission all reuse
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import NamedTuple

from client.cli_help import DefaultsHelpFormatter
from loadgen.bench.seed_metrics import markdown_table
from loadgen.workload import Request, multi_turn, shared_prefix
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire.messages import SamplingParams
from scheduler.wire.rank_messages import StepResult
from scheduler.wire.serve_config import CheckpointAdmission, CheckpointEviction, SchedulingConfig

VOCAB = 256


class SimResult(NamedTuple):
    hit_rate: float  # cached / prompt tokens
    num_stored: int  # checkpoints the tree took
    num_prefill_chunks: int  # a prompt split at a store point takes one chunk (a step) more


def simulate(requests: list[Request], slots: int, eviction: str, concurrency: int,
             interval: int, cache_finished: bool, admission: str = "all",
             seed: int = 0) -> SimResult:
    kv_rows = 4 * sum(len(r.prompt) + r.max_tokens for r in requests)
    s = Scheduler(SchedulingConfig(
        max_total_tokens=kv_rows, max_running_requests=concurrency, chunked_prefill_size=2048,
        checkpoint_interval=interval, cache_finished=cache_finished, checkpoint_eviction=eviction,
        checkpoint_admission=admission, park_finished=False),  # the checkpoints alone
        RankLimits(num_checkpoint_slots=slots, max_context_len=1 << 20, vocab_size=VOCAB))
    rng = random.Random(seed)
    todo, done, in_flight = list(range(len(requests))), set(), set()
    num_chunks = 0
    while todo or in_flight:
        for i in list(todo):
            if len(in_flight) >= concurrency:
                break
            dep = requests[i].depends_on
            if dep is None or dep in done:
                todo.remove(i)
                in_flight.add(i)
                r = requests[i]
                assert s.add(str(i), r.prompt, SamplingParams(max_tokens=r.max_tokens,
                                                               ignore_eos=True)) is None
        plan = s.schedule()
        num_chunks += sum(q.prefix_len < len(requests[int(q.rid)].prompt) for q in plan.seqs)
        n = sum(q.sample is not None for q in plan.seqs)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        for out in s.process_result(StepResult(plan.step_id, tokens, 0.0, [0.0] * n)):
            if out.finished:
                in_flight.discard(int(out.rid))
                done.add(int(out.rid))
    s.check_integrity()
    stats = s.stats
    return SimResult(stats.cached_tokens / stats.prompt_tokens, stats.checkpoints_stored,
                     num_chunks)


WORKLOADS = ("shared-prefix", "multi-turn")


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[Request], int, bool]]:
    """name -> (requests, checkpoint interval, cache finished)."""
    out = {}
    if "shared-prefix" in args.workload:
        name = f"shared-prefix ({args.prefix_len} + 32, interval 256)"
        out[name] = (shared_prefix_requests(args), 256, True)
    if "multi-turn" in args.workload:
        mt = multi_turn(args.groups, args.per_group, 512, 64, (0, VOCAB), args.seed,
                        args.max_tokens)
        out["multi-turn (512 + 64 a turn, interval 256)"] = (mt, 256, True)
    return out


def shared_prefix_requests(args: argparse.Namespace) -> list[Request]:
    sp = shared_prefix(args.groups, args.per_group, args.prefix_len, 32, (0, VOCAB), args.seed,
                       args.max_tokens)
    random.Random(args.seed).shuffle(sp)  # groups interleave, cold ones still go first
    order = {id(r): i for i, r in enumerate(sp)}
    firsts = {r.tags["group"]: order[id(r)] for r in sp if r.tags["cold"]}
    for r in sp:
        r.depends_on = None if r.tags["cold"] else firsts[r.tags["group"]]
    return sp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadgen.bench.eviction_sim",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32],
                   help="checkpoint slots (the state pool)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--groups", type=int, default=16, help="prefix groups / conversations")
    p.add_argument("--per-group", type=int, default=8, help="prompts / turns of each")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each request generates")
    p.add_argument("--seed", type=int, default=0, help="prompts and their order")
    p.add_argument("--admission", nargs="+", choices=list(CheckpointAdmission),
                   default=list(CheckpointAdmission),
                   help="checkpoint admission policies to compare (--checkpoint-admission)")
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="which workloads to run")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens every prompt of a group shares")
    args = p.parse_args(argv)
    header = ["workload", "slots", "admission", *[f"hit rate {e}" for e in CheckpointEviction],
              *[f"stored / chunks {e}" for e in CheckpointEviction]]
    rows = []
    for name, (reqs, interval, finished) in workloads(args).items():
        for slots in args.slots:
            for admission in args.admission:
                res = [simulate(reqs, slots, e, args.concurrency, interval, finished, admission)
                       for e in CheckpointEviction]
                rows.append([name, str(slots), admission, *[f"{x.hit_rate:.3f}" for x in res],
                             *[f"{x.num_stored} / {x.num_prefill_chunks}" for x in res]])
                print(rows[-1], file=sys.stderr, flush=True)
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
