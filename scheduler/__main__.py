"""The scheduler process: ``python -m scheduler ...`` (started by dasc-serve).

Loop: take the front end's messages, plan one step, send it to rank 0, wait for the sampled
tokens, send the new tokens back.  Steps are strictly sequential, so aborts and flushes arrive
between steps, never while a plan is in flight.
"""

from __future__ import annotations

import argparse
import sys
import time
from multiprocessing.connection import Connection

from scheduler import ipc
from scheduler.messages import (
    AbortReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    RankInfo,
    ServerInfo,
    Shutdown,
    Stats,
    StatsReq,
    StepResult,
)
from scheduler.policy import POLICIES, SchedulePolicy
from scheduler.radix_cache import CKPT_EVICTIONS, DEFAULT_CKPT_EVICTION
from scheduler.scheduler import Scheduler, SchedulerConfig, prefill_budget

IDLE_POLL_S = 0.5
DEFAULT = SchedulePolicy()  # lpm: docs/results/serving.md, "Schedule policies"


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """Policy flags; ``dasc-serve`` declares the same ones and passes them through."""
    g = p.add_argument_group("scheduling and prefix cache")
    g.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV pool size in tokens (page size 1)")
    g.add_argument("--max-running-requests", type=int, default=16,
                   help="requests decoded together (active state slots)")
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="new tokens per step, decodes included (default: 2048, or derived "
                        "with --step-target-ms)")
    g.add_argument("--step-target-ms", type=float, default=None,
                   help="derive --chunked-prefill-size from the prefill rate the ranks measure "
                        "at start-up: the tokens a step prefills in this time (64 to 8192), so "
                        "decodes never wait behind a whole long prompt (default: off)")
    g.add_argument("--checkpoint-interval", type=int, default=256,
                   help="store a checkpoint every N prompt tokens (0: at the prompt end only)")
    g.add_argument("--schedule-policy", choices=POLICIES, default=DEFAULT.name,
                   help="which prefill a step takes first: fcfs (arrival order) or lpm (shortest "
                        "remaining prefill after the cached prefix first, so hits do not wait "
                        "behind misses)")
    g.add_argument("--schedule-max-passes", type=int, default=DEFAULT.max_passes,
                   help="lpm's fairness bound: a request overtaken by this many later arrivals "
                        "goes first")
    g.add_argument("--prefill-mix-ratio", type=float, default=DEFAULT.mix_ratio,
                   help="lpm: a step holding prefill chunks defers a chunk more than this many "
                        "times longer than its longest one to the next step (0: never defer)")
    g.add_argument("--decode-interleave", type=int, default=DEFAULT.decode_steps, metavar="N",
                   help="while requests decode, a step carries prefill only after N "
                        "decode-only steps, so a decode waits behind one prefill step in N + 1 "
                        "at most, and a prompt waits N decode steps at most (0: every step may "
                        "carry prefill)")
    g.add_argument("--checkpoint-eviction", choices=CKPT_EVICTIONS,
                   default=DEFAULT_CKPT_EVICTION,
                   help="which checkpoint a full pool drops: lru (least recently hit) or reuse "
                        "(recency plus the prefill a hit there saves over its nearest cached "
                        "ancestor)")
    g.add_argument("--no-prefix-cache", action="store_true", help="never match nor store")
    g.add_argument("--no-cache-finished", action="store_true",
                   help="do not cache prompt + output when a request finishes")


class SchedulerProcess:
    def __init__(self, sched: Scheduler, rank: Connection, front: Connection):
        self.sched, self.rank, self.front = sched, rank, front
        self.step_s = self.compute_s = 0.0
        self.num_steps = 0

    def run(self) -> None:
        while True:
            if not self._take_messages(block=not self.sched.has_work):
                return
            started = time.perf_counter()
            plan = self.sched.schedule()
            if plan is None:
                continue
            ipc.send(self.rank, plan)
            result = ipc.recv(self.rank)
            if not isinstance(result, StepResult) or result.step_id != plan.step_id:
                raise RuntimeError(f"rank 0 answered step {plan.step_id} with {result!r}")
            for out in self.sched.process_result(result):
                ipc.send(self.front, out)
            self.step_s += time.perf_counter() - started
            self.compute_s += result.compute_s
            self.num_steps += 1

    def stats(self) -> Stats:
        sched, cache = self.sched, self.sched.cache
        try:
            sched.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"failed: {e}"
        counters = dict(sched.stats, kv_evicted_rows=cache.num_kv_evicted,
                        checkpoints_evicted=cache.num_ckpt_evicted)
        return Stats(cache.kv_pool.size, cache.kv_pool.num_free, cache.num_cached_rows,
                     cache.ckpt_pool.size, cache.ckpt_pool.num_free, cache.num_cached_ckpts,
                     len(sched.running), len(sched.waiting), counters, self.num_steps,
                     self.step_s, self.compute_s, integrity)

    def _take_messages(self, block: bool) -> bool:
        """Handle every waiting message; False when the server is stopping."""
        timeout = IDLE_POLL_S if block else 0.0
        while self.front.poll(timeout):
            timeout = 0.0
            msg = ipc.recv(self.front)
            if isinstance(msg, GenerateReq):
                refused = self.sched.add(msg.rid, msg.prompt_ids, msg.sampling)
                if refused is not None:
                    ipc.send(self.front, refused)
            elif isinstance(msg, AbortReq):
                self.sched.abort(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.sched.flush()
                ipc.send(self.front, FlushCacheDone(True, "cache flushed"))
            elif isinstance(msg, StatsReq):
                ipc.send(self.front, self.stats())
            elif isinstance(msg, Shutdown):
                return False
        if block:
            self.sched.check_integrity()  # idle time: prove the books balance
        return True


DEFAULT_CHUNKED_PREFILL = 2048


def chunk_budget(args: argparse.Namespace, info: RankInfo) -> int:
    if args.chunked_prefill_size is not None:
        return args.chunked_prefill_size
    if args.step_target_ms is not None:
        return prefill_budget(info.prefill_tokens_per_s, args.step_target_ms)
    return DEFAULT_CHUNKED_PREFILL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scheduler",
                                description="dasc scheduler process (started by dasc-serve).")
    p.add_argument("--rank-port", type=int, required=True)
    p.add_argument("--frontend-port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--wmax", type=float, default=0.0)
    p.add_argument("--load-policy", default="nr")
    add_scheduler_args(p)
    args, _ = p.parse_known_args(argv)
    rank_listener = ipc.listen(args.rank_port)
    front_listener = ipc.listen(args.frontend_port)
    # the front end first: its handshake must not wait on a rank that may never connect (the
    # launcher watches the ranks while it waits for ServerInfo and stops everything if they die)
    front = ipc.accept(front_listener)
    rank = ipc.accept(rank_listener)
    info = ipc.recv(rank)
    if not isinstance(info, RankInfo):
        print(f"error: scheduler: rank 0 sent {type(info).__name__} instead of RankInfo",
              file=sys.stderr)
        return 1
    cfg = SchedulerConfig(
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        num_checkpoint_slots=info.num_checkpoint_slots,
        max_context_len=info.max_context_len,
        vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id,
        chunked_prefill_size=chunk_budget(args, info),
        checkpoint_interval=args.checkpoint_interval,
        prefix_cache=not args.no_prefix_cache,
        cache_finished=not args.no_cache_finished,
        load_policy=args.load_policy,
        refresh_window=info.refresh_window,
        policy=SchedulePolicy(args.schedule_policy, args.schedule_max_passes,
                              args.prefill_mix_ratio, args.decode_interleave),
        ckpt_eviction=args.checkpoint_eviction,
    )
    ipc.send(front, ServerInfo(
        args.model, info.model_type, info.tp_size, info.vocab_size, info.eos_token_id,
        cfg.max_total_tokens, info.max_context_len, cfg.max_running_requests,
        info.num_checkpoint_slots, info.checkpoint_bytes_per_slot, info.dense_bytes_per_slot,
        args.wmax, args.load_policy, info.refresh_window, cfg.prefix_cache,
        info.checkpoint_format, cfg.chunked_prefill_size))
    proc = SchedulerProcess(Scheduler(cfg), rank, front)
    try:
        proc.run()
    except (EOFError, ConnectionError) as e:
        print(f"error: scheduler: lost a connection ({type(e).__name__})", file=sys.stderr)
        return 1
    finally:
        try:
            ipc.send(rank, Shutdown())
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
