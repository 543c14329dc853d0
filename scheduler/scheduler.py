"""Scheduling policy: admission, chunked prefill, continuous decode, checkpoint stores and loads.

No I/O here: ``schedule()`` turns the queue into one ``BatchPlan`` and ``process_result()`` turns
the ranks' sampled tokens into the step's ``TokenOut``s (one ``TokenBatch`` frame), so the whole
policy runs in tests without a model or a process.

The scheduler delegates: ``RequestTable`` (scheduler/request_table.py) holds the requests and
what they own, ``StepPlanner`` (scheduler/step_planner.py) builds each step's plan, and
``process_result`` (scheduler/result_processor.py) reads the ranks' result back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from scheduler.cache_tier import CacheTier, TierEntry
from scheduler.index_pool import IndexPool
from scheduler.limits import RankLimits
from scheduler.radix_cache import RadixCache
from scheduler.request import Req
from scheduler.request_table import RequestTable
from scheduler.result_processor import process_result
from scheduler.step_planner import StepPlanner
from scheduler.wire.messages import Counters, SamplingParams, TokenOut
from scheduler.wire.rank_messages import BatchPlan, StepResult, TierMove
from scheduler.wire.serve_config import SchedulingConfig


class Scheduler:
    def __init__(self, cfg: SchedulingConfig, limits: RankLimits, tier: CacheTier | None = None):
        """``tier``: the second cache tier (``scheduler/cache_tier.py``), or None."""
        self.cfg, self.limits = cfg, limits
        self.table = RequestTable(cfg, limits, tier)
        self.planner = StepPlanner(self.table)

    @property
    def cache(self) -> RadixCache:
        return self.table.cache

    @property
    def slots(self) -> IndexPool:
        return self.table.slots

    @property
    def waiting(self) -> deque[Req]:
        return self.table.waiting

    @property
    def running(self) -> list[Req]:
        return self.table.running

    @property
    def stats(self) -> Counters:
        """A snapshot of the counters, the cache's evictions included."""
        return replace(self.table.counters, kv_evicted_rows=self.cache.num_kv_evicted,
                       checkpoints_evicted=self.cache.num_ckpt_evicted)

    # ---- requests in ----------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], sampling: SamplingParams) -> TokenOut | None:
        """Queue a request, or return the finished error frame that refuses it."""
        return self.table.add(rid, prompt, sampling)

    def abort(self, rid: str) -> bool:
        """Drop a request between steps (no step is in flight when this runs); False if it
        is not waiting or running.  No frame: the front end stops listening to a request
        before it asks for the abort."""
        return self.table.abort(rid)

    @property
    def tier(self) -> CacheTier | None:
        return self.table.tier

    def flush(self) -> None:
        """Empty both tiers (the second's files are deleted)."""
        self.cache.flush()
        if self.tier is not None:
            self.tier.drop_all()

    @property
    def has_work(self) -> bool:
        """Something to plan: requests, stores, or the second tier's spills to send and writes
        to confirm (an idle scheduler sends a ``tier_sync`` plan for those)."""
        table, tier = self.table, self.table.tier
        return bool(table.waiting or table.running or table.stores_before
                    or (tier is not None and (tier.has_moves or tier.has_pending)))

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        plan = self.planner.schedule()
        tier = self.tier
        if tier is None:
            return plan
        if plan is None and (tier.has_moves or tier.has_pending):
            plan = BatchPlan(self.planner.next_step_id(), tier_sync=True)
        if plan is not None:
            plan.spills, plan.tier_free = tier.take_moves()
        return plan

    def spill_all(self) -> BatchPlan | None:
        """At shutdown: a plan that writes every cached checkpoint the tier lacks and waits for
        all of the tier's writes; None without a tier."""
        if self.tier is None:
            return None
        table = self.table
        table.spill_all()
        plan = BatchPlan(self.planner.next_step_id(), stores_before=table.stores_before,
                         tier_sync=True)
        plan.spills, plan.tier_free = self.tier.take_moves()
        table.stores_before = []
        plan.release, plan.tables = table.take_table_changes()
        return plan

    def process_result(self, result: StepResult) -> list[TokenOut]:
        inflight, fetches = self.planner.step_done(result.compute_s)
        self.table.counters.screened_tokens += result.screened
        if self.tier is not None:
            self._tier_result(result, fetches)
        return process_result(self.table, inflight, result)

    def _tier_result(self, result: StepResult,
                     fetches: list[tuple[TierMove, TierEntry]]) -> None:
        """Confirm the tier's writes; put each fetched prefix into the radix tree with its
        checkpoint (its request, still waiting, is admitted next step as a hit there)."""
        tier, cache = self.tier, self.cache
        tier.written(result.tier_written, result.tier_write_failed)
        failed = set(result.tier_fetch_failed)
        for move, entry in fetches:
            ok = entry.id not in failed
            tier.fetched(entry, ok, result.tier_fetch_s / len(fetches))
            if not ok:
                cache.kv_pool.free(move.rows)
                cache.ckpt_pool.free([move.slot])
                continue
            res = cache.insert(list(entry.tokens), move.rows, move.slot)
            cache.kv_pool.free(move.rows[: res.num_existing])  # the tree had those already
            if res.ckpt_taken:
                self.table.counters.checkpoints_stored += 1
            else:
                cache.ckpt_pool.free([move.slot])

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every row and slot is free, cached in one node, owned by one running request or
        by a second-tier fetch in flight."""
        moves = self.planner.fetch_moves
        self.table.check_integrity([x for m in moves for x in m.rows], [m.slot for m in moves])
