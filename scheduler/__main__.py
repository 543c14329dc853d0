"""The scheduler process: ``python -m scheduler --config JSON ...`` (started by dasc-serve).

Loop: take the front end's messages, plan one step, send it to rank 0, wait for the sampled
tokens, send the step's new tokens back in one ``TokenBatch``.  Steps are strictly sequential,
so aborts and flushes arrive between steps, never while a plan is in flight.  Its settings are
the ``SchedulingConfig`` of the ``ServeConfig`` the launcher built (``dasc_server.flags``).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TextIO

from model_runner import cpu_affinity
from scheduler.cache_tier import ENTRY_OVERHEAD, CacheTier, tell
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire import ipc
from scheduler.wire.messages import (
    AbortReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    ServerInfo,
    Shutdown,
    Stats,
    StatsReq,
    TokenBatch,
)
from scheduler.wire.rank_messages import BatchPlan, RankInfo, StepResult
from scheduler.wire.serve_config import SchedulingConfig, ServeConfig

IDLE_POLL_S = 0.5
QUIET_S = 0.05  # idle this long before the integrity check runs


class SchedulerProcess:
    def __init__(self, sched: Scheduler, rank: Connection, front: Connection):
        self.sched, self.rank, self.front = sched, rank, front
        self.step_s = self.compute_s = 0.0
        self.num_steps = 0
        self._checked = False  # the books were checked since the last step
        self._finished_at: float | None = None  # when the last step that finished requests ended
        self._step_log: TextIO | None = None  # --step-log, open while ``run`` runs

    def run(self) -> None:
        """Plan and run steps until the front end stops the server."""
        log = self.sched.cfg.step_log
        with open(log, "a", buffering=1) if log else nullcontext() as self._step_log:
            self._run_steps()

    def _run_steps(self) -> None:
        while True:
            if not self._take_messages(block=not self.sched.has_work):
                return
            if not self._wait_for_more_prompts():
                return
            started = time.perf_counter()
            plan = self.sched.schedule()
            if plan is None:
                continue
            ipc.send(self.rank, plan)
            result = ipc.recv(self.rank)
            if not isinstance(result, StepResult) or result.step_id != plan.step_id:
                raise RuntimeError(f"rank 0 answered step {plan.step_id} with {result!r}")
            outs = self.sched.process_result(result)
            self._checked = False
            if outs:
                ipc.send(self.front, TokenBatch(outs))
                if any(out.finished for out in outs):
                    self._finished_at = time.perf_counter()
            wall_s = time.perf_counter() - started
            self.step_s += wall_s
            if self._step_log is not None:
                self._step_log.write(step_line(plan, time.time() - wall_s, wall_s,
                                               result.compute_s))
            self.compute_s += result.compute_s
            self.num_steps += 1

    def flush_tier(self) -> None:
        """At shutdown: write every cached checkpoint the tier lacks, wait for all writes,
        compact the index."""
        tier = self.sched.tier
        if tier is None or tier.root is None:  # a host-memory tier ends with the process
            return
        plan = self.sched.spill_all()
        if plan.spills:
            size = sum(tier.entries[m.entry].nbytes for m in plan.spills)
            tell(f"writing {len(plan.spills)} entries ({size / 2**20:.1f} MiB) before exit")
        ipc.send(self.rank, plan)
        result = ipc.recv(self.rank)
        if isinstance(result, StepResult):
            tier.written(result.tier_written, result.tier_write_failed)
        tier.close()
        s = tier.snapshot()
        tell(f"{tier.root}: {s.entries} entries ({s.bytes / 2**20:.1f} MiB) kept")

    def stats(self) -> Stats:
        sched, cache = self.sched, self.sched.cache
        try:
            sched.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"failed: {e}"
        return Stats(cache.kv_pool.size, cache.kv_pool.num_free, cache.num_cached_rows,
                     cache.ckpt_pool.size, cache.ckpt_pool.num_free, cache.num_cached_ckpts,
                     len(sched.running), len(sched.waiting), sched.stats, self.num_steps,
                     self.step_s, self.compute_s, integrity,
                     sched.tier.snapshot() if sched.tier is not None else None)

    def _wait_for_more_prompts(self) -> bool:
        """Before a step that would only start prompts (nothing decoding), take the prompts
        that arrive within ``batch_wait_ms``: counted from the end of the previous step when it
        finished requests (their clients often send the next turn at once), else from now.
        Prompts that arrive together then prefill in one step and decode in the same steps;
        otherwise the second one's prefill lands in the step of the first one's first decode,
        which waits behind it.  False when the server is stopping."""
        wait_s = self.sched.cfg.batch_wait_ms / 1000.0
        if not wait_s or self.sched.running or not self.sched.waiting:
            return True
        now = time.perf_counter()
        finished_at, self._finished_at = self._finished_at, None
        if finished_at is None or now - finished_at > wait_s:
            finished_at = now
        deadline = finished_at + wait_s
        while (left := deadline - time.perf_counter()) > 0:
            if self.front.poll(left) and not self._take_messages(block=False):
                return False
        return True

    def _take_messages(self, block: bool) -> bool:
        """Handle every waiting message; False when the server is stopping.  Going idle, it
        proves the books balance once per idle spell, after ``QUIET_S`` without a message and
        before the long wait.  Not at once: under load a step often finishes every running
        request (one-token answers) while the next requests are still on their way through the
        front end, and a check then (a few ms with a large KV pool) delayed the next step.  Not
        after the wait either: a request that wakes the loop is planned at once."""
        if block and not self._checked and not self.front.poll(QUIET_S):
            self.sched.check_integrity()
            self._checked = True
        timeout = IDLE_POLL_S if block else 0.0
        while self.front.poll(timeout):
            timeout = 0.0
            msg = ipc.recv(self.front)
            if isinstance(msg, GenerateReq):
                refused = self.sched.add(msg.rid, msg.prompt_ids, msg.sampling)
                if refused is not None:
                    ipc.send(self.front, TokenBatch([refused]))
            elif isinstance(msg, AbortReq):
                self.sched.abort(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.sched.flush()
                self._checked = False
                ipc.send(self.front, FlushCacheDone(True, "cache flushed"))
            elif isinstance(msg, StatsReq):
                ipc.send(self.front, self.stats())
            elif isinstance(msg, Shutdown):
                return False
        return True


def step_line(plan: BatchPlan, started: float, wall_s: float, compute_s: float) -> str:
    """One ``--step-log`` line: when the step started (Unix seconds), its wall and rank-0
    seconds, its id, each sequence as rid:start+tokens (``s``: it samples, ``cN``: N cuts
    inside it), and its checkpoint loads and stores (before and after the forward)."""
    seqs = " ".join(f"{q.rid}:{q.prefix_len}+{len(q.token_ids)}{'s' if q.sample else ''}"
                    f"{f'c{len(q.snapshots)}' if q.snapshots else ''}" for q in plan.seqs)
    return (f"{started:.3f} {wall_s:.3f} {compute_s:.3f} step={plan.step_id} [{seqs}] "
            f"loads={len(plan.loads)} stores={len(plan.stores_before)}+{len(plan.stores_after)}"
            "\n")


def prefill_budget(tokens_per_s: float, step_target_ms: float, low: int = 64,
                   high: int = 8192) -> int:
    """New tokens per step so that a step's prefill takes about ``step_target_ms`` at the
    measured prefill rate: a multiple of 64 in [low, high].  Decodes share every step with the
    prefill chunks, so this bounds how long a decode waits behind a long prompt."""
    tokens = int(tokens_per_s * step_target_ms / 1000.0) // 64 * 64
    return min(high, max(low, tokens))


def chunk_budget(cfg: SchedulingConfig, info: RankInfo) -> int:
    if cfg.chunked_prefill_size is None and cfg.step_target_ms is not None:
        return prefill_budget(info.prefill_tokens_per_s, cfg.step_target_ms)
    return cfg.chunk_tokens


def scheduler_args(cfg: ServeConfig, info: RankInfo) -> tuple[SchedulingConfig, RankLimits]:
    """The scheduler's config (its chunk budget resolved) and the limits the ranks reported."""
    s = cfg.scheduling
    limits = RankLimits(num_checkpoint_slots=info.num_checkpoint_slots,
                        max_context_len=info.max_context_len, vocab_size=info.vocab_size,
                        eos_token_id=info.eos_token_id, load_policy=cfg.checkpoints.load_policy,
                        refresh_window=info.refresh_window)
    return replace(s, chunked_prefill_size=chunk_budget(s, info)), limits


def open_tier(config: ServeConfig, info: RankInfo) -> CacheTier | None:
    """The second cache tier of ``--cache-tier-dir`` (restored) or ``--host-tier-bytes`` (None:
    off, or a directory that cannot be written)."""
    cfg = config.tier
    if not cfg.enabled or not config.scheduling.prefix_cache:
        return None
    per_rank = info.tier_slot_bytes + ENTRY_OVERHEAD

    def entry_bytes(num_tokens: int) -> int:
        return info.tp_size * (per_rank + num_tokens * info.kv_bytes_per_token)

    return CacheTier.open(cfg, info.tier_fingerprint, info.tp_size, entry_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scheduler",
                                description="dasc scheduler process (started by dasc-serve).")
    p.add_argument("--rank-fd", type=int, required=True,
                   help="inherited listening socket rank 0 connects to")
    p.add_argument("--frontend-fd", type=int, required=True,
                   help="inherited listening socket the front end connects to")
    p.add_argument("--config", required=True, help="the ServeConfig, as JSON")
    args = p.parse_args(argv)
    try:
        config = ServeConfig.from_json(args.config)
    except ValueError as e:
        print(f"error: scheduler: {e}", file=sys.stderr)
        return 2
    if config.ranks.cpu_bind:  # off the ranks' CPUs
        cpu_affinity.bind_rest()
    rank_listener = ipc.InheritedListener(args.rank_fd)  # bound by the launcher
    front_listener = ipc.InheritedListener(args.frontend_fd)
    # the front end first: its handshake must not wait on a rank that may never connect (the
    # launcher watches the ranks while it waits for ServerInfo and stops everything if they die)
    front = ipc.accept(front_listener)
    rank = ipc.accept(rank_listener)
    info = ipc.recv(rank)
    if not isinstance(info, RankInfo):
        print(f"error: scheduler: rank 0 sent {type(info).__name__} instead of RankInfo",
              file=sys.stderr)
        return 1
    cfg, limits = scheduler_args(config, info)
    tier = open_tier(config, info)
    ipc.send(front, ServerInfo(config, info, cfg.chunked_prefill_size))
    proc = SchedulerProcess(Scheduler(cfg, limits, tier), rank, front)
    try:
        proc.run()
        proc.flush_tier()
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
