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

from scheduler.admission import check_admission
from scheduler.index_pool import IndexPool
from scheduler.radix_cache import RadixCache
from scheduler.request import Req
from scheduler.request_table import RequestTable
from scheduler.result_processor import process_result
from scheduler.scheduler_config import SchedulerConfig
from scheduler.step_planner import StepPlanner
from scheduler.wire.messages import Counters, SamplingParams, TokenOut
from scheduler.wire.rank_messages import BatchPlan, StepResult


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        check_admission(cfg.checkpoint_admission)
        self.cfg = cfg
        self.table = RequestTable(cfg)
        self.planner = StepPlanner(cfg, self.table)

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

    def flush(self) -> None:
        self.cache.flush()

    @property
    def has_work(self) -> bool:
        table = self.table
        return bool(table.waiting or table.running or table.stores_before)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        return self.planner.schedule()

    def process_result(self, result: StepResult) -> list[TokenOut]:
        self.planner.observe(result.compute_s)
        outs = process_result(self.table, self.planner.inflight, result)
        self.planner.inflight = []
        return outs

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every row and slot is free, cached in one node, or owned by one running request."""
        self.table.check_integrity()
