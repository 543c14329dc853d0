"""The scheduler process's loop without I/O (``Loop``: schedule, execute on ``FakeRanks``,
process_result, integrity checks after each), a small default config, and prompt and token
sources for the scheduler tests."""

from __future__ import annotations

import random

from scheduler.cache_tier import CacheTier
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire.messages import SamplingParams, TokenOut
from scheduler.wire.rank_messages import BatchPlan, StepResult
from scheduler.wire.serve_config import CacheTierConfig, SchedulingConfig
from support.fake_ranks import FakeRanks

EOS = 0


def make(tier: CacheTier | None = None, **kw) -> Scheduler:
    """A scheduler of small pools; ``kw`` sets fields of its ``SchedulingConfig`` and of the
    ``RankLimits`` (checkpoint slots, context, vocabulary, eos, load policy, refresh window)."""
    base = dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=8,
                max_context_len=4096, vocab_size=64, eos_token_id=EOS, chunked_prefill_size=32,
                checkpoint_interval=8)
    base.update(kw)
    limits = {k: base.pop(k) for k in RankLimits.__dataclass_fields__ if k in base}
    return Scheduler(SchedulingConfig(**base), RankLimits(**limits), tier)


def make_tier(directory, budget: int, eviction: str = "reuse", tp_size: int = 1,
              host: bool = False) -> CacheTier:
    """A second tier in ``directory`` (``host``: in the ranks' memory) whose entries cost 100
    bytes plus one a token."""
    cfg = CacheTierConfig(cache_tier_dir=None if host else str(directory), cache_tier_bytes=budget,
                          cache_tier_eviction=eviction, host_tier_bytes=budget if host else None)
    return CacheTier.open(cfg, "f" * 64, tp_size, lambda n: 100 + n)


class Loop:
    """The scheduler process's loop without I/O: schedule, execute, process_result."""

    def __init__(self, s: Scheduler, token_fn, step_s=None, fetch_fails=None):
        """``step_s(plan)``: the ranks' time for a plan (``StepResult.compute_s``; 0 if None);
        ``fetch_fails(move)``: whether a second-tier fetch fails its checks (never if None).
        Every spill is written within its step."""
        self.s, self.token_fn, self.step_s = s, token_fn, step_s
        self.fetch_fails = fetch_fails
        self.ranks = FakeRanks(s)
        self.outs: dict[str, list[TokenOut]] = {}
        self.plans: list[BatchPlan] = []
        self.reqs = {}  # rid -> Req, tracked while it is queued or running
        self.aborted = {}  # rid -> Req that abort() dropped

    def add(self, rid: str, prompt: list[int], max_tokens: int, **kw) -> TokenOut | None:
        out = self.s.add(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))
        if out is None:
            self.reqs[rid] = self.s.waiting[-1]
        self.outs.setdefault(rid, []).extend([out] if out else [])
        self.s.check_integrity()
        return out

    def abort(self, rid: str) -> None:
        r = self.reqs.get(rid)
        is_live = r is not None and r.finish_reason is None
        assert self.s.abort(rid) is is_live
        if is_live:
            assert r.finish_reason == "abort"
            self.aborted[rid] = self.reqs.pop(rid)
        self.s.check_integrity()
        self.check_ckpt_counter()

    def check_ckpt_counter(self) -> None:
        """Every checkpoint the tree took was counted: stored - evicted = cached."""
        s = self.s
        assert s.stats.checkpoints_stored - s.stats.checkpoints_evicted == \
            s.cache.num_cached_ckpts

    def step(self) -> BatchPlan | None:
        s = self.s
        plan = s.schedule()
        s.check_integrity()
        if plan is None:
            return None
        return self.execute(plan)

    def execute(self, plan: BatchPlan) -> BatchPlan:
        """Run ``plan`` on the fake ranks and read its result back."""
        s = self.s
        self.plans.append(plan)
        failed = [m.entry for m in plan.fetches if self.fetch_fails and self.fetch_fails(m)]
        self.ranks.execute(plan, frozenset(failed))
        running = list(s.running)
        tokens = [self.token_fn(q) for q in plan.seqs if q.sample is not None]
        compute_s = self.step_s(plan) if self.step_s else 0.0
        outs = s.process_result(StepResult(plan.step_id, tokens, compute_s, [0.0] * len(tokens),
                                           tier_written=[m.entry for m in plan.spills],
                                           tier_fetch_failed=failed))
        s.check_integrity()
        self.check_ckpt_counter()
        for o in outs:
            self.outs[o.rid].append(o)
        self.ranks.note_finished([r for r in running if r.finish_reason not in (None, "abort")])
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_work:
                return
            assert self.step() is not None, "work left but nothing schedulable"
        raise AssertionError("the scheduler did not drain")

    def final(self, rid: str) -> TokenOut:
        frames = self.outs[rid]
        assert sum(o.finished for o in frames) == 1 and frames[-1].finished
        return frames[-1]

    def output(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.token_ids]


def assert_drained(s: Scheduler) -> None:
    cache = s.cache
    s.check_integrity()
    assert not s.running and not s.waiting and not s.has_work
    assert cache.kv_pool.num_free + cache.num_cached_rows == cache.kv_pool.size
    assert cache.ckpt_pool.num_free + cache.num_cached_ckpts == cache.ckpt_pool.size
    assert s.slots.num_free + cache.num_parked == s.cfg.max_running_requests
    s.flush()
    s.check_integrity()
    assert s.slots.num_free == s.cfg.max_running_requests and not cache.num_parked
    assert not cache.root.children
    assert cache.kv_pool.num_free == cache.kv_pool.size
    assert cache.ckpt_pool.num_free == cache.ckpt_pool.size


def random_tokens(seed: int = 0):
    rng = random.Random(seed)
    return lambda q: rng.randrange(1, 64)


def run_one(loop: Loop, rid: str, prompt: list[int], max_tokens: int) -> BatchPlan:
    """Add one request, drain, and return the plan that admitted it."""
    num_plans = len(loop.plans)
    assert loop.add(rid, prompt, max_tokens) is None
    loop.run()
    return loop.plans[num_plans]


def prompt_of(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]
