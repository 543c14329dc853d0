"""Scheduler policy (scheduler/scheduler.py) driven like the real loop, with a CPU stand-in for
the ranks that executes every BatchPlan on symbolic contents: each KV row, active slot and
checkpoint slot holds the identity of the token prefix it encodes, so a wrong row, a stale or
overwritten checkpoint, or a slot shared by two requests shows up as a mismatch."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_radix_cache import prefix_hashes

from scheduler.admission import MIN_BRANCH_GAIN
from scheduler.messages import (
    BatchPlan,
    RowTables,
    SamplingParams,
    SeqStep,
    StepResult,
    TokenOut,
)
from scheduler.policy import SchedulePolicy
from scheduler.radix_cache import Node
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.serve_config import LoadPolicy

ROOT = Path(__file__).resolve().parent.parent
EOS = 0



def state_of(tokens: list[int]) -> tuple[int, int]:
    return (len(tokens), prefix_hashes(tokens)[-1] if tokens else 0)


def boundaries(prompt_len: int, every: int) -> set[int]:
    """Where the policy may store a checkpoint while prefilling (written out independently)."""
    points = {k * every for k in range(1, prompt_len) if every and k * every < prompt_len - 1}
    return points | ({prompt_len - 1} if prompt_len > 1 else set())


def may_store(s: Scheduler, prompt: list[int], end: int) -> bool:
    """Whether the admission policy may store after prompt[:end] while prefilling.  Under
    reuse the branch point was read from the tree before the step's later evictions, which
    only remove checkpoints, so its gain over the deepest one above it can only have grown."""
    if s.cfg.ckpt_admission == "all":
        return end in boundaries(len(prompt), s.cfg.checkpoint_interval)
    return end == len(prompt) - 1 or end - s.cache.match_len(prompt, end) >= MIN_BRANCH_GAIN


def tree_ckpts(s: Scheduler) -> dict[int, tuple[list[int], Node]]:
    """Checkpoint slot -> (token path, node) of every cached checkpoint."""
    out, stack = {}, [([], s.cache.root)]
    while stack:
        path, node = stack.pop()
        if node.ckpt is not None:
            out[node.ckpt] = (path, node)
        stack.extend((path + child.key, child) for child in node.children.values())
    return out


class FakeRanks:
    """Executes plans in the documented order on symbolic contents and checks each step."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.row: dict[int, int] = {}  # KV row -> prefix hash of the position it holds
        self.active: dict[int, tuple[int, int]] = {}  # state slot -> (length, prefix hash)
        self.ckpt: dict[int, tuple[int, int]] = {}
        self.last_step = 0
        self.finished_slots: dict[int, list[int]] = {}  # slot -> tokens of a just-finished req
        self.num_loads = self.num_stores = self.num_refresh = 0
        self.tables = RowTables()

    def kv_rows(self, q: SeqStep) -> list[int]:
        return self.tables.rows(q.rid)[: q.prefix_len + len(q.token_ids)]

    def execute(self, plan: BatchPlan) -> None:
        s, cfg = self.s, self.s.cfg
        assert plan.step_id > self.last_step
        self.last_step = plan.step_id
        # (0) row tables: exactly the running requests', each equal to the scheduler's rows
        self.tables.apply(plan)
        assert len(self.tables) == len(s.running)
        for r in s.running:
            assert self.tables.rows(r.rid) == r.rows
        by_slot = {r.slot: r for r in s.running}
        in_tree = tree_ckpts(s)
        rows_in_tree = {x for n in s.cache._nodes() for x in n.value}
        free_rows = s.cache.kv_pool.free_ids()

        # (1) states of requests that finished last step
        before_slots = [a for a, _ in plan.stores_before]
        assert len(before_slots) == len(set(before_slots))
        for active, c in plan.stores_before:
            tokens = self.finished_slots.pop(active)  # only finished requests store before
            assert self.active[active] == state_of(tokens)
            self.ckpt[c] = self.active[active]
            self.num_stores += 1
        self.finished_slots.clear()
        # (2) loads: only checkpoints the tree holds, into the slot of a request of this plan
        seq_slots = [q.state_slot for q in plan.seqs]
        assert len(seq_slots) == len(set(seq_slots)), "two sequences share a state slot"
        for c, active in plan.loads:
            assert c in in_tree, "a load reads a checkpoint the tree does not hold"
            path, node = in_tree[c]
            r = by_slot[active]
            assert r.hit_len == len(path) == node.depth and r.prompt[: len(path)] == path
            assert self.ckpt[c] == state_of(path), "the loaded checkpoint holds another prefix"
            self.active[active] = self.ckpt[c]
            self.num_loads += 1
        # (3) dasc-wr refresh: read-only replay of the tokens before the hit into scratch slots
        assert len(plan.refresh_scratch) == len(plan.refresh)
        assert len(set(plan.refresh_scratch)) == len(plan.refresh_scratch)
        loaded = {a for _, a in plan.loads}
        for q, scratch in zip(plan.refresh, plan.refresh_scratch):
            assert cfg.scratch_slot_base <= scratch < cfg.num_state_slots
            assert q.state_slot in loaded
            r = by_slot[q.state_slot]
            end = q.prefix_len + len(q.token_ids)
            kv_rows = self.kv_rows(q)
            assert end == r.hit_len and len(kv_rows) == end
            assert q.prefix_len == max(0, end - cfg.refresh_window)
            assert q.token_ids == r.prompt[q.prefix_len : end] and q.sample is None
            hs = prefix_hashes(r.prompt[:end])
            assert [self.row[x] for x in kv_rows] == hs
            self.num_refresh += 1
        if cfg.load_policy is not LoadPolicy.WR or cfg.refresh_window <= 0:
            assert not plan.refresh
        # (4) forward
        written: set[int] = set()
        for q in plan.seqs:
            assert 1 <= q.state_slot < cfg.scratch_slot_base
            r = by_slot[q.state_slot]
            n, kv_rows = len(q.token_ids), self.kv_rows(q)
            assert n >= 1 and len(kv_rows) == q.prefix_len + n
            assert q.prefix_len == r.computed
            full = r.all_tokens[: q.prefix_len + n]
            assert q.token_ids == full[q.prefix_len :]
            assert (q.sample is not None) == (q.prefix_len + n == len(r.all_tokens))
            if q.sample is not None:
                assert q.sample.index == len(r.output) and q.sample.seed == r.seed
            if q.prefix_len:
                assert self.active[q.state_slot] == state_of(full[: q.prefix_len]), \
                    "the state slot does not hold this request's prefix"
            hs = prefix_hashes(full)
            assert [self.row[x] for x in kv_rows[: q.prefix_len]] == hs[: q.prefix_len]
            new_rows = kv_rows[q.prefix_len :]
            assert not set(new_rows) & written, "two sequences write the same KV row"
            assert not set(new_rows) & (rows_in_tree | free_rows)
            assert not set(kv_rows) & free_rows
            written.update(new_rows)
            for x, h in zip(new_rows, hs[q.prefix_len :]):
                self.row[x] = h
            self.active[q.state_slot] = state_of(full)
        # (5) checkpoints at chunk ends on the boundary grid
        after_ckpts = [c for _, c in plan.stores_after]
        assert len(after_ckpts) == len(set(after_ckpts))
        assert not set(after_ckpts) & set(in_tree), "a store overwrites a cached checkpoint"
        assert not set(after_ckpts) & {c for c, _ in plan.loads}
        for active, c in plan.stores_after:
            assert active in seq_slots
            r = by_slot[active]
            end = r.computed + len(plan.seqs[seq_slots.index(active)].token_ids)
            assert cfg.prefix_cache and may_store(s, r.prompt, end)
            assert s.cache.ckpt_at(r.prompt[:end]) is None
            self.ckpt[c] = self.active[active]
            self.num_stores += 1
        self.check_tree()

    def check_tree(self) -> None:
        """After a plan ran, every cached row and checkpoint holds exactly its path."""
        stack = [([], self.s.cache.root)]
        while stack:
            path, node = stack.pop()
            if path:
                hs = prefix_hashes(path)
                assert [self.row[x] for x in self.s.cache.rows_to(node)] == hs
                if node.ckpt is not None:
                    assert self.ckpt[node.ckpt] == (len(path), hs[-1])
            stack.extend((path + child.key, child) for child in node.children.values())

    def note_finished(self, reqs: list) -> None:
        for r in reqs:
            self.finished_slots[r.slot] = r.all_tokens[:-1]


def make(**kw) -> Scheduler:
    base = dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=8,
                max_context_len=4096, vocab_size=64, eos_token_id=EOS, chunked_prefill_size=32,
                checkpoint_interval=8)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


class Loop:
    """The scheduler process's loop without I/O: schedule, execute, process_result."""

    def __init__(self, s: Scheduler, token_fn):
        self.s, self.token_fn = s, token_fn
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
        self.plans.append(plan)
        self.ranks.execute(plan)
        running = list(s.running)
        tokens = [self.token_fn(q) for q in plan.seqs if q.sample is not None]
        outs = s.process_result(StepResult(plan.step_id, tokens, 0.0, [0.0] * len(tokens)))
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
    assert s.slots.num_free == s.cfg.max_running_requests
    s.flush()
    s.check_integrity()
    assert not cache.root.children
    assert cache.kv_pool.num_free == cache.kv_pool.size
    assert cache.ckpt_pool.num_free == cache.ckpt_pool.size


def random_tokens(seed: int = 0):
    rng = random.Random(seed)
    return lambda q: rng.randrange(1, 64)


# ---- seeded random workloads ---------------------------------------------------------------------


CONFIGS = [
    # KV rows, active slots and checkpoint slots all tight
    dict(max_total_tokens=260, max_running_requests=3, num_checkpoint_slots=6,
         chunked_prefill_size=24, checkpoint_interval=8),
    dict(max_total_tokens=400, max_running_requests=5, num_checkpoint_slots=3,
         chunked_prefill_size=64, checkpoint_interval=16),
    dict(max_total_tokens=300, max_running_requests=2, num_checkpoint_slots=12,
         chunked_prefill_size=7, checkpoint_interval=12, load_policy=LoadPolicy.WR,
         refresh_window=6),
    dict(max_total_tokens=500, max_running_requests=6, num_checkpoint_slots=1,
         chunked_prefill_size=40, checkpoint_interval=0),
    dict(max_total_tokens=200, max_running_requests=4, num_checkpoint_slots=5,
         chunked_prefill_size=16, checkpoint_interval=8, cache_finished=False),
    dict(max_total_tokens=300, max_running_requests=3, num_checkpoint_slots=4,
         chunked_prefill_size=24, checkpoint_interval=8, prefix_cache=False),
    # enough checkpoint slots that hits are common; KV rows still tight
    dict(max_total_tokens=330, max_running_requests=4, num_checkpoint_slots=24,
         chunked_prefill_size=32, checkpoint_interval=16),
    # lpm reorders admissions and defers chunks (scheduler/policy.py): the books still balance
    dict(max_total_tokens=330, max_running_requests=4, num_checkpoint_slots=24,
         chunked_prefill_size=32, checkpoint_interval=16, policy=SchedulePolicy("lpm", 4)),
    dict(max_total_tokens=260, max_running_requests=3, num_checkpoint_slots=6,
         chunked_prefill_size=24, checkpoint_interval=8, load_policy=LoadPolicy.WR,
         refresh_window=6,
         policy=SchedulePolicy("lpm", max_passes=1000, mix_ratio=2)),
    # checkpoint eviction by value (scheduler/radix_cache.py, ckpt_eviction="reuse")
    dict(max_total_tokens=400, max_running_requests=5, num_checkpoint_slots=3,
         chunked_prefill_size=64, checkpoint_interval=16, ckpt_eviction="reuse"),
    # checkpoint admission by likely reuse (scheduler/admission.py)
    dict(max_total_tokens=400, max_running_requests=4, num_checkpoint_slots=6,
         chunked_prefill_size=32, checkpoint_interval=8, ckpt_admission="reuse"),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_random_workload(cfg, seed):
    rng = random.Random(seed * 1000 + CONFIGS.index(cfg))
    s = make(**cfg)

    def token_fn(q):
        return EOS if rng.random() < 0.08 else rng.randrange(1, 64)

    loop = Loop(s, token_fn)
    limit = min(s.cfg.max_total_tokens, s.cfg.max_context_len)
    bases = [[rng.randrange(1, 64) for _ in range(rng.randint(3, 70))] for _ in range(4)]
    num_reqs, added, done = 150, 0, {}
    for _ in range(20_000):
        if added < num_reqs and rng.random() < 0.35:
            for _ in range(min(rng.randint(1, 3), num_reqs - added)):
                kind = rng.random()
                if done and kind < 0.15:  # exact repeat
                    prompt = list(rng.choice(list(done.values())).prompt)
                else:
                    if done and kind < 0.4:  # next turn of a conversation
                        r = rng.choice(list(done.values()))
                        prompt = r.prompt + r.output
                    else:  # shared prefix, cut anywhere
                        base = rng.choice(bases)
                        prompt = base[: rng.randint(1, len(base))]
                    prompt += [rng.randrange(1, 64) for _ in range(rng.randint(0, 30))]
                max_tokens = rng.randint(1, 12)
                prompt = prompt[: limit - max_tokens]
                out = loop.add(f"r{added}", prompt, max_tokens)
                assert out is None, out
                added += 1
        if rng.random() < 0.03 and loop.reqs:
            loop.abort(rng.choice(list(loop.reqs)))
        if rng.random() < 0.02 and s.running:
            loop.abort(rng.choice(s.running).rid)
        if rng.random() < 0.01:
            s.flush()
            s.check_integrity()
        if s.has_work:
            assert loop.step() is not None, "work left but nothing schedulable"
        for rid in list(loop.reqs):
            if loop.outs[rid] and loop.outs[rid][-1].finished:
                done[rid] = loop.reqs.pop(rid)
        assert len(s.running) <= s.cfg.max_running_requests
        if added == num_reqs and not s.has_work:
            break
    else:
        raise AssertionError("the workload did not drain")

    assert not loop.reqs
    reasons = set()
    for rid, r in done.items():
        last = loop.final(rid)
        assert last.finish_reason != "error"
        assert last.finish_reason == r.finish_reason
        reasons.add(last.finish_reason)
        assert loop.output(rid) == r.output and last.prompt_tokens == len(r.prompt)
        assert all(o.cached_tokens == r.hit_len for o in loop.outs[rid])
        assert r.hit_len <= len(r.prompt) - 1
        if r.finish_reason == "length":
            assert len(r.output) == r.sampling.max_tokens and EOS not in r.output
        elif r.finish_reason == "stop":
            assert r.output.index(EOS) == len(r.output) - 1
    assert reasons >= {"length", "stop"} and len(done) + len(loop.aborted) == num_reqs
    assert loop.aborted, "the workload aborted nothing"
    for rid, r in loop.aborted.items():  # no frame ends an aborted stream
        assert not any(o.finished for o in loop.outs[rid]) and loop.output(rid) == r.output
    stats = loop.ranks
    if s.cfg.prefix_cache:
        assert stats.num_stores > 0
        assert stats.num_loads > 0 or s.cfg.num_checkpoint_slots == 1  # 1 slot: LRU churns
        if s.cfg.load_policy is LoadPolicy.WR:
            assert stats.num_refresh == stats.num_loads
    else:
        assert stats.num_loads == stats.num_stores == 0 and s.stats.cached_tokens == 0
    assert_drained(s)


# ---- targeted policy tests -----------------------------------------------------------------------


def run_one(loop: Loop, rid: str, prompt: list[int], max_tokens: int) -> BatchPlan:
    """Add one request, drain, and return the plan that admitted it."""
    num_plans = len(loop.plans)
    assert loop.add(rid, prompt, max_tokens) is None
    loop.run()
    return loop.plans[num_plans]


def prompt_of(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 5, 21, 37])
def test_exact_repeat_hits_one_token_early_and_tail_of_one_is_sampled(n):
    s = make(checkpoint_interval=8)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(n)
    run_one(loop, "a", prompt, 3)
    assert loop.final("a").cached_tokens == 0
    plan = run_one(loop, "b", prompt, 3)
    assert loop.final("b").cached_tokens == n - 1
    assert len(plan.loads) == 1
    (seq,) = plan.seqs  # SGLang #29633: a 1-token tail, sampled
    assert seq.token_ids == prompt[-1:] and seq.prefix_len == n - 1 and seq.sample is not None
    assert seq.rid == "b" and len(plan.tables["b"]) >= n
    assert_drained(s)


def test_prompt_shorter_than_the_interval_hits_on_repeat():
    s = make(checkpoint_interval=64)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(6)
    run_one(loop, "a", prompt, 1)
    run_one(loop, "b", prompt, 1)
    assert loop.final("b").cached_tokens == len(prompt) - 1


def test_second_turn_hits_at_the_processed_length_of_the_first():
    s = make(checkpoint_interval=8)
    loop = Loop(s, random_tokens(3))
    prompt = prompt_of(19)
    run_one(loop, "t1", prompt, 5)
    out1 = loop.output("t1")
    assert len(out1) == 5 and loop.final("t1").finish_reason == "length"
    turn2 = prompt + out1 + prompt_of(7, seed=9)
    plan = run_one(loop, "t2", turn2, 4)
    processed = len(prompt) + len(out1) - 1  # the last sampled token was never fed
    assert loop.final("t2").cached_tokens == processed
    assert len(plan.loads) == 1 and plan.seqs[0].prefix_len == processed
    assert_drained(s)


def test_every_checkpoint_store_is_counted():
    """Issue 18: the stores made when a request finishes (prompt + output) went uncounted, so
    /v1/stats showed fewer checkpoints stored than cached.  With no eviction the counter is
    the number of slots the ranks wrote and the tree holds."""
    s = make(num_checkpoint_slots=16, checkpoint_interval=8)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(20)
    run_one(loop, "a", prompt, 4)  # prefill stores at 8, 16, 19; on finish at 23
    turn2 = prompt + loop.output("a") + prompt_of(5, seed=7)
    run_one(loop, "b", turn2, 3)  # hit at 23; stores at 24, 28; on finish at 31
    assert loop.final("b").cached_tokens == 23
    assert sum(len(p.stores_before) for p in loop.plans) == 2  # the finish stores
    assert s.cache.num_ckpt_evicted == 0
    assert s.stats.checkpoints_stored == loop.ranks.num_stores == s.cache.num_cached_ckpts \
        == 7
    assert_drained(s)


def test_shared_prefix_hits_at_the_interval_grid():
    """SGLang #28222: requests sharing a prefix hit at the last grid point inside it."""
    every = 8
    s = make(checkpoint_interval=every)
    loop = Loop(s, random_tokens())
    shared, tail_a, tail_b = prompt_of(29), prompt_of(11, seed=2), prompt_of(5, seed=3)
    assert tail_a[0] != tail_b[0]
    run_one(loop, "a", shared + tail_a, 2)
    run_one(loop, "b", shared + tail_b, 2)
    assert loop.final("b").cached_tokens == len(shared) // every * every


def test_no_prefix_cache_matches_and_stores_nothing():
    s = make(prefix_cache=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(30)
    run_one(loop, "a", prompt, 3)
    run_one(loop, "b", prompt, 3)
    assert loop.final("b").cached_tokens == 0
    for plan in loop.plans:
        assert not plan.loads and not plan.stores_after and not plan.stores_before
    assert not s.cache.root.children and s.cache.ckpt_pool.num_free == s.cfg.num_checkpoint_slots
    assert_drained(s)


@pytest.mark.parametrize("window,hit_len", [(4, 20), (50, 20), (1, 3)])
def test_wr_hit_plans_a_refresh_into_a_scratch_slot(window, hit_len):
    s = make(load_policy=LoadPolicy.WR, refresh_window=window, checkpoint_interval=0)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(hit_len + 1)
    run_one(loop, "a", prompt, 1)
    plan = run_one(loop, "b", prompt, 2)
    (q,) = plan.refresh
    replay = min(window, hit_len)
    assert q.token_ids == prompt[hit_len - replay : hit_len] and q.prefix_len == hit_len - replay
    assert q.state_slot == plan.seqs[0].state_slot == plan.loads[0][1]
    assert plan.refresh_scratch[0] >= s.cfg.scratch_slot_base
    assert s.stats.loads_wr == 1 and s.stats.refresh_tokens == replay
    assert s.stats.loads(LoadPolicy.WR) == 1 and s.stats.loads(LoadPolicy.NR) == 0
    assert_drained(s)


def test_nr_plans_no_refresh():
    s = make(load_policy=LoadPolicy.NR, refresh_window=8)
    loop = Loop(s, random_tokens())
    run_one(loop, "a", prompt_of(20), 1)
    plan = run_one(loop, "b", prompt_of(20), 1)
    assert plan.loads and not plan.refresh and not plan.refresh_scratch
    assert s.stats.loads(LoadPolicy.NR) == 1 and s.stats.loads_wr == s.stats.refresh_tokens == 0


@pytest.mark.parametrize("pressure", ["slots", "rows", "ckpts"])
def test_more_requests_than_capacity_wait_and_all_finish(pressure):
    kw = {"slots": dict(max_running_requests=2),
          "rows": dict(max_total_tokens=60, max_running_requests=8),
          "ckpts": dict(num_checkpoint_slots=1, max_running_requests=8)}[pressure]
    s = make(**kw)
    loop = Loop(s, random_tokens())
    num = 12
    for i in range(num):
        assert loop.add(f"r{i}", prompt_of(13 + 3 * i, seed=i % 4)[: 50 - 8], 8) is None
    waited = waited_with_free_slot = False
    while s.has_work:
        assert loop.step() is not None
        assert len(s.running) <= s.cfg.max_running_requests
        waited |= bool(s.waiting)
        waited_with_free_slot |= bool(s.waiting) and s.slots.num_free > 0
    for i in range(num):
        assert loop.final(f"r{i}").finish_reason == "length"
    assert waited
    if pressure == "rows":
        assert waited_with_free_slot
    if pressure == "ckpts":
        assert s.cache.num_ckpt_evicted > 0
    assert_drained(s)


def test_consumed_checkpoint_survives_stores_planned_in_the_same_step():
    """One checkpoint slot: a hit locks it, so the store its own chunk wants gets nothing
    rather than evicting (and overwriting) the state being loaded in the same step."""
    s = make(num_checkpoint_slots=1, checkpoint_interval=0, cache_finished=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(17)
    run_one(loop, "a", prompt, 1)
    (cached,) = tree_ckpts(s)
    assert s.cache.ckpt_at(prompt[:16]) == cached
    longer = prompt + prompt_of(9, seed=5)
    assert s.add("b", longer, SamplingParams(max_tokens=2)) is None
    plan = s.schedule()
    assert plan.loads == [(cached, plan.seqs[0].state_slot)]
    # the chunk ends at the new prompt-end boundary, but the only slot is being loaded
    assert plan.seqs[0].prefix_len + len(plan.seqs[0].token_ids) == len(longer) - 1
    assert plan.stores_after == []
    assert s.cache.ckpt_at(prompt[:16]) == cached
    s.check_integrity()


def test_abort_waiting_and_running_requests():
    s = make(max_running_requests=1, policy=SchedulePolicy("fcfs"))  # "run" first
    loop = Loop(s, random_tokens())
    loop.add("run", prompt_of(30), 5)
    loop.add("wait", prompt_of(12, seed=4), 5)
    loop.step()
    assert [r.rid for r in s.running] == ["run"] and [r.rid for r in s.waiting] == ["wait"]
    loop.abort("wait")  # asserts abort() is True, the request's reason "abort"
    loop.abort("run")
    assert set(loop.aborted) == {"wait", "run"} and not s.running and not s.waiting
    assert not loop.outs["wait"] and not any(o.finished for o in loop.outs["run"])
    assert s.abort("nobody") is False and s.abort("run") is False
    assert_drained(s)


def test_a_request_id_in_flight_is_refused_until_it_ends():
    s = make()
    loop = Loop(s, random_tokens())
    assert loop.add("a", prompt_of(9), 3) is None
    dup = s.add("a", prompt_of(5, seed=2), SamplingParams(max_tokens=2))  # would share
    # the outputs and the ranks' KV-row table
    assert dup.finished and dup.finish_reason == "error" and "already in flight" in dup.error
    loop.step()
    assert s.add("a", prompt_of(5), SamplingParams(max_tokens=2)).finish_reason == "error"
    loop.run()
    assert loop.add("a", prompt_of(5, seed=2), 2) is None  # ended: the id is free again
    loop.abort("a")
    assert loop.add("a", prompt_of(7, seed=3), 2) is None  # aborted while waiting: free too
    loop.run()
    assert_drained(s)


def test_requests_that_can_never_fit_are_refused_at_add():
    s = make(max_total_tokens=100, max_context_len=80, vocab_size=64)
    bad = {
        "empty": ([], 4),
        "vocab": ([1, 64], 4),
        "negative": ([1, -1], 4),
        "zero": ([1, 2], 0),
        "context": (prompt_of(78), 3),
    }
    for rid, (prompt, max_tokens) in bad.items():
        out = s.add(rid, prompt, SamplingParams(max_tokens=max_tokens))
        assert out is not None and out.finished and out.finish_reason == "error"
        assert out.error and out.rid == rid and out.token_ids == []
    s2 = make(max_total_tokens=50, max_context_len=4096)
    out = s2.add("rows", prompt_of(45), SamplingParams(max_tokens=6))
    assert out is not None and out.finish_reason == "error"
    assert not s.has_work and not s2.has_work
    assert s.add("ok", prompt_of(78), SamplingParams(max_tokens=2)) is None  # at the limit


# ---- torch-free import ---------------------------------------------------------------------------


def test_scheduler_imports_no_torch():
    code = ("import sys\n"
            "import scheduler, scheduler.scheduler, scheduler.radix_cache, scheduler.messages, "
            "scheduler.ipc\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_prefill_budget_follows_the_measured_rate():
    from scheduler.scheduler import prefill_budget

    # 1,000 tokens/s and a 250 ms step: 250 tokens, rounded down to 192 (multiples of 64)
    assert prefill_budget(1000.0, 250.0) == 192
    assert prefill_budget(4096.0, 250.0) == 1024
    assert prefill_budget(8000.0, 500.0) == 4000 // 64 * 64
    assert prefill_budget(10.0, 250.0) == 64  # never below one 64-token chunk
    assert prefill_budget(1e7, 250.0) == 8192  # nor above the cap


def test_ipc_connections_send_small_frames_at_once(monkeypatch):
    """Both ends of an engine connection set TCP_NODELAY (issue 18: Nagle held tokens back),
    and a message still round-trips."""
    import os
    import socket
    import threading

    from scheduler import ipc
    from scheduler.messages import Shutdown

    monkeypatch.setenv(ipc.AUTHKEY_ENV, ipc.new_authkey())
    port = ipc.free_port()
    listener = ipc.listen(port)
    client: list = []
    t = threading.Thread(target=lambda: client.append(ipc.connect(port, timeout=10)))
    t.start()
    server = ipc.accept(listener)
    t.join(10)
    try:
        for conn in (server, client[0]):
            with socket.socket(fileno=os.dup(conn.fileno())) as s:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        ipc.send(client[0], Shutdown())
        assert isinstance(ipc.recv(server), Shutdown)
    finally:
        server.close()
        client[0].close()
        listener.close()


def test_chunk_budget_flags():
    """An explicit --chunked-prefill-size wins; --step-target-ms derives the budget from the
    rate rank 0 measured; neither keeps the default."""
    from dasc_server.flags import parse_args, serve_config
    from scheduler.__main__ import DEFAULT_CHUNKED_PREFILL, chunk_budget
    from scheduler.messages import RankInfo

    info = RankInfo("qwen3_next", 1, 64, None, 4096, 4, 100, 100, 0, prefill_tokens_per_s=4096.0)

    def budget(*flags: str) -> int:
        return chunk_budget(serve_config(parse_args(list(flags))).scheduling, info)

    assert budget("--step-target-ms", "250") == 1024
    assert budget("--chunked-prefill-size", "300", "--step-target-ms", "250") == 300
    assert budget() == DEFAULT_CHUNKED_PREFILL == 2048


# ---- logit controls ------------------------------------------------------------------------------


def test_bad_logit_controls_are_refused_at_add_with_a_clear_message():
    import math
    import re

    s = make()
    bad = {
        "logit_bias token ids must lie in \\[0, 64\\), got 64": dict(logit_bias={64: 1.0}),
        "logit_bias token ids must lie in \\[0, 64\\), got -1": dict(logit_bias={-1: 1.0}),
        "logit_bias token ids must lie in \\[0, 64\\), got '5'": dict(logit_bias={"5": 1.0}),
        "logit_bias values must lie in \\[-100, 100\\], got 100.5 for 3":
            dict(logit_bias={3: 100.5}),
        "logit_bias values must lie in \\[-100, 100\\], got nan": dict(logit_bias={3: math.nan}),
        "logit_bias must map token ids": dict(logit_bias=[3], min_tokens=1),
        "presence_penalty must lie in \\[-2, 2\\], got 2.5": dict(presence_penalty=2.5),
        "frequency_penalty must lie in \\[-2, 2\\], got -3": dict(frequency_penalty=-3),
        "frequency_penalty must lie in \\[-2, 2\\], got inf": dict(frequency_penalty=math.inf),
        "repetition_penalty must be a number > 0, got 0": dict(repetition_penalty=0.0),
        "repetition_penalty must be a number > 0, got -1": dict(repetition_penalty=-1.0),
        "min_tokens must be at least 0, got -1": dict(min_tokens=-1),
        "min_tokens \\(5\\) must not exceed max_tokens \\(4\\)": dict(min_tokens=5),
    }
    for i, (message, kw) in enumerate(bad.items()):
        out = s.add(f"bad{i}", prompt_of(5), SamplingParams(max_tokens=4, **kw))
        assert out is not None and out.finish_reason == "error", kw
        assert re.search(message, out.error), (message, out.error)
    good = [dict(logit_bias={0: -100, 63: 100.0}), dict(presence_penalty=-2.0),
            dict(frequency_penalty=2), dict(repetition_penalty=0.01), dict(min_tokens=4)]
    for i, kw in enumerate(good):
        assert s.add(f"good{i}", prompt_of(5), SamplingParams(max_tokens=4, **kw)) is None
    assert not s.running and len(s.waiting) == len(good)


def test_logit_controls_travel_once_with_the_first_sample():
    s = make(chunked_prefill_size=8, eos_token_id=EOS)
    loop = Loop(s, random_tokens(1))
    prompt = [5, 9, 5, 11] * 5  # three prefill chunks
    loop.add("plain", prompt_of(6), 5)
    loop.add("ctl", prompt, 6, logit_bias={3: 2.5}, repetition_penalty=1.2, min_tokens=2,
             stop_token_ids=[4, 99], presence_penalty=0.5)
    loop.add("eos", prompt_of(7), 3, min_tokens=1, ignore_eos=True, frequency_penalty=1.0)
    loop.run()
    samples = {rid: [] for rid in ("plain", "ctl", "eos")}
    for plan in loop.plans:
        for q in plan.seqs:
            if q.sample is not None:
                samples[q.rid].append(q.sample)
    assert [len(v) for v in samples.values()] == [5, 6, 3]
    assert all(x.controls is None for x in samples["plain"])
    for rid in ("ctl", "eos"):
        assert samples[rid][0].index == 0 and samples[rid][0].controls is not None
        assert all(x.controls is None for x in samples[rid][1:])
    c = samples["ctl"][0].controls
    assert c.logit_bias == {3: 2.5} and c.repetition_penalty == 1.2 and c.min_tokens == 2
    assert c.presence_penalty == 0.5 and c.frequency_penalty == 0.0
    assert c.banned_ids == [4, EOS]  # 99 lies outside the vocabulary: never sampled anyway
    assert c.prompt_ids == [5, 9, 11]
    e = samples["eos"][0].controls
    assert e.banned_ids == [] and e.prompt_ids == []  # ignore_eos: EOS is not a stop
    assert_drained(s)
