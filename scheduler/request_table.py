"""The requests the scheduler holds and everything they own: the waiting and running queues, KV
rows and checkpoints (through the radix cache), active state slots, and what the next plan must
carry about them (new row tables, dropped tables, stores of finished requests' states).

On finish the state after every processed token (prompt + output[:-1]) is cached too, so the
next turn of a conversation hits: as a checkpoint in the plan's format, and (``park_finished``)
by leaving the request's own active slot in the tree, exact, until an admission needs the slot
(``RadixCache.park``).  The next turn then adopts the slot: no load and no dasc-wr refresh.
"""

from __future__ import annotations

import random
from collections import deque

from scheduler.cache_tier import CacheTier
from scheduler.index_pool import IndexPool
from scheduler.limits import RankLimits
from scheduler.radix_cache import RadixCache
from scheduler.refusals import check_request
from scheduler.request import Req
from scheduler.wire.messages import Counters, SamplingParams, TokenOut
from scheduler.wire.serve_config import SchedulingConfig


class RequestTable:
    def __init__(self, cfg: SchedulingConfig, limits: RankLimits, tier: CacheTier | None = None):
        self.cfg, self.limits, self.tier = cfg, limits, tier
        self.slots = IndexPool(cfg.max_running_requests, first=1)
        self.cache = RadixCache(IndexPool(cfg.max_total_tokens),
                                IndexPool(limits.num_checkpoint_slots), cfg.checkpoint_eviction,
                                slot_pool=self.slots if cfg.park_finished else None)
        if tier is not None:
            self.cache.on_drop_ckpt = self._spill
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stores_before: list[tuple[int, int]] = []  # (active slot, checkpoint) to store
        self.new_tables: dict[str, Req] = {}  # row tables the next plan carries
        self.released: list[str] = []  # ended requests whose tables the next plan drops
        self.counters = Counters()  # the cache counts the evictions
        self._live: set[str] = set()  # ids of waiting and running requests
        self._num_added = 0
        self._rng = random.Random(0)

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams) -> TokenOut | None:
        """Queue a request, or return the finished error frame that refuses it."""
        error = check_request(self.limits, self.cfg.max_total_tokens, prompt, sampling)
        if rid in self._live:  # outputs and the ranks' row tables are keyed by it
            error = f"request id {rid!r} is already in flight"
        if error is not None:
            return TokenOut(rid, [], finished=True, finish_reason="error",
                            prompt_tokens=len(prompt), error=error)
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        self.waiting.append(Req(rid, list(prompt), sampling, seed, arrival=self._num_added))
        self._num_added += 1
        self._live.add(rid)
        return None

    def abort(self, rid: str) -> bool:
        """Drop a waiting or running request; False if it is neither."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                self._live.discard(rid)
                r.finish_reason = "abort"
                return True
        for r in self.running:
            if r.rid == rid:
                self.finish(r, "abort")
                return True
        return False

    def _spill(self, node) -> bool:
        """The radix cache is dropping ``node``'s checkpoint: keep it in the second tier (not
        one still waiting in ``stores_before``: its slot does not hold it yet)."""
        cache = self.cache
        if any(ckpt == node.ckpt for _, ckpt in self.stores_before):
            return False
        return self.tier.spill(cache.tokens_to(node), node.ckpt, cache.rows_to(node))

    def spill_all(self) -> int:
        """Queue every cached checkpoint the tier lacks, most recently hit first (at
        shutdown, so the tier keeps what the pool holds); returns how many."""
        return sum(self._spill(n) for n in self.cache.checkpoint_nodes())

    def take_table_changes(self) -> tuple[list[str], dict[str, list[int]]]:
        """(released ids, new row tables) for the next plan; both start empty again."""
        released, self.released = self.released, []
        tables = {rid: r.rows for rid, r in self.new_tables.items()}
        self.new_tables = {}
        return released, tables

    def cache_prefix(self, r: Req, end: int, ckpt: int | None) -> bool:
        """Hand [0, end) of the request to the tree with a checkpoint at ``end`` (None: KV
        only); the request keeps a lock on the new node and adopts the tree's rows.  False: no
        checkpoint was taken (the tree already had one there; ``ckpt`` went back to the
        pool)."""
        res = self.cache.insert(r.token_slice(0, end), r.rows[:end], ckpt)
        if res.ckpt_taken:
            self.counters.checkpoints_stored += 1
        elif ckpt is not None:
            self.cache.ckpt_pool.free([ckpt])
        if res.num_existing > r.cached_len:  # someone cached these tokens first: drop ours
            self.cache.kv_pool.free(r.rows[r.cached_len : res.num_existing])
            self.new_tables[r.rid] = r  # the ranks need the tree's rows instead
        self.cache.lock(res.node)
        self.cache.unlock(r.node)
        r.rows = res.kv_rows + r.rows[end:]
        r.node, r.cached_len = res.node, end
        return res.ckpt_taken

    def finish(self, r: Req, reason: str) -> None:
        r.finish_reason = reason
        self.running.remove(r)
        cache = self.cache
        end = r.computed
        caches = reason != "abort" and self.cfg.prefix_cache and self.cfg.cache_finished
        if caches and end > r.cached_len and cache.ckpt_at(r.token_slice(0, end)) is None:
            ckpt = cache.alloc_ckpt()
            if ckpt is not None and self.cache_prefix(r, end, ckpt):
                # written at the start of the next step, before any load can read it
                self.stores_before.append((r.slot, ckpt))
        if caches and self.cfg.park_finished and end > 0:
            if r.node.depth != end:  # the tree holds a checkpoint at end already: KV only
                self.cache_prefix(r, end, None)
            parked = cache.park(r.node, r.slot)
        else:
            parked = False
        cache.kv_pool.free(r.own_rows)
        cache.unlock(r.node)
        if not parked:
            self.slots.free([r.slot])
        r.node, r.rows = None, []
        self.new_tables.pop(r.rid, None)
        self.released.append(r.rid)
        self._live.discard(r.rid)

    def check_integrity(self, fetch_rows: list[int] = (), fetch_ckpts: list[int] = ()) -> None:
        """Every row and slot is free, cached in one node, or owned by one running request
        (or by a fetch in flight: ``fetch_rows``, ``fetch_ckpts``)."""
        rows = [x for r in self.running for x in r.own_rows] + list(fetch_rows)
        ckpts = [ckpt for r in self.running for _, ckpt in r.pending_stores] + list(fetch_ckpts)
        held = [r.slot for r in self.running]
        self.cache.check_integrity(rows, ckpts, [r.node for r in self.running], [], held)
        assert len(held) == len(set(held)) and not set(held) & self.slots.free_ids()
        assert len(held) + self.cache.num_parked + self.slots.num_free == self.slots.size, \
            "active slot leaked"
