"""A CPU stand-in for the ranks that executes every BatchPlan on symbolic contents: each KV row,
active slot and checkpoint slot holds the identity of the token prefix it encodes, so a wrong
row, a stale or overwritten checkpoint, or a slot shared by two requests shows up as a
mismatch.  Used by the scheduler tests through ``support.scheduler_helpers.Loop``."""

from __future__ import annotations

from scheduler.admission import MIN_BRANCH_GAIN
from scheduler.radix_cache import Node
from scheduler.scheduler import Scheduler
from scheduler.wire.rank_messages import BatchPlan, RowTables, SeqStep
from scheduler.wire.serve_config import LoadPolicy
from support.radix_helpers import prefix_hashes


def state_of(tokens: list[int]) -> tuple[int, int]:
    return (len(tokens), prefix_hashes(tokens)[-1] if tokens else 0)


def boundaries(prompt_len: int, every: int) -> set[int]:
    """Where the policy may store a checkpoint while prefilling (written out independently)."""
    points = {k * every for k in range(1, prompt_len) if every and k * every < prompt_len - 1}
    return points | ({prompt_len - 1} if prompt_len > 1 else set())


def may_store(s: Scheduler, prompt: list[int], end: int) -> bool:
    """Whether the admission policy may store after prompt[:end] while prefilling.  Under
    reuse (and branch) the branch point was read from the tree before the step's later
    evictions, which only remove checkpoints, so its gain over the deepest one above it can only
    have grown."""
    on_grid = end in boundaries(len(prompt), s.cfg.checkpoint_interval)
    if s.cfg.checkpoint_admission == "all":
        return on_grid
    at_branch = end == len(prompt) - 1 or end - s.cache.match_len(prompt, end) >= MIN_BRANCH_GAIN
    return at_branch if s.cfg.checkpoint_admission == "reuse" else on_grid or at_branch


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
        self.disk: dict[int, tuple[list[int], tuple[int, int]]] = {}  # tier entry -> contents
        self.num_fetches = 0

    def kv_rows(self, q: SeqStep) -> list[int]:
        return self.tables.rows(q.rid)[: q.prefix_len + len(q.token_ids)]

    def execute(self, plan: BatchPlan, fetch_failed: frozenset[int] = frozenset()) -> None:
        s, cfg = self.s, self.s.cfg
        assert plan.step_id > self.last_step
        self.last_step = plan.step_id
        self.spills(plan)
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
            assert q.prefix_len == max(0, end - s.limits.refresh_window)
            assert q.token_ids == r.prompt[q.prefix_len : end] and q.sample is None
            hs = prefix_hashes(r.prompt[:end])
            assert [self.row[x] for x in kv_rows] == hs
            self.num_refresh += 1
        if s.limits.load_policy is not LoadPolicy.WR or s.limits.refresh_window <= 0:
            assert not plan.refresh
        # (4) forward; a snapshot slot (a scratch slot: only a request's own replay may share
        # it) gets the state at its cut
        written: set[int] = set()
        snapshots: dict[int, tuple[int, int]] = {}  # snapshot slot -> (state slot, prefix len)
        scratch = dict(zip((x.state_slot for x in plan.refresh), plan.refresh_scratch))
        for q in plan.seqs:
            cuts = [c for c, _ in q.snapshots]
            assert cuts == sorted(set(cuts)) and all(0 < c < len(q.token_ids) for c in cuts)
            for _, slot in q.snapshots:
                assert cfg.scratch_slot_base <= slot < cfg.num_state_slots
                assert slot not in snapshots, "two snapshots share a slot"
                assert slot not in set(plan.refresh_scratch) - {scratch.get(q.state_slot)}, \
                    "a snapshot takes another request's scratch"
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
            for cut, slot in q.snapshots:
                self.active[slot] = state_of(full[: q.prefix_len + cut])
                snapshots[slot] = (q.state_slot, q.prefix_len + cut)
        # (5) checkpoints at chunk ends on the boundary grid
        after_ckpts = [c for _, c in plan.stores_after]
        assert len(after_ckpts) == len(set(after_ckpts))
        assert not set(after_ckpts) & set(in_tree), "a store overwrites a cached checkpoint"
        assert not set(after_ckpts) & {c for c, _ in plan.loads}
        for active, c in plan.stores_after:
            if active in snapshots:
                r, end = by_slot[snapshots[active][0]], snapshots[active][1]
            else:
                assert active in seq_slots
                r = by_slot[active]
                end = r.computed + len(plan.seqs[seq_slots.index(active)].token_ids)
            assert cfg.prefix_cache and may_store(s, r.prompt, end)
            assert s.cache.ckpt_at(r.prompt[:end]) is None
            self.ckpt[c] = self.active[active]
            self.num_stores += 1
        self.fetches(plan, fetch_failed)
        self.check_tree()

    def spills(self, plan: BatchPlan) -> None:
        """Spills copy out rows and a slot that hold exactly the entry's prefix (first: the
        step may reuse them)."""
        if self.s.tier is None:
            assert not plan.spills and not plan.fetches and not plan.tier_sync
        for entry in plan.tier_free:  # host memory: a later fetch of it fails the test
            assert self.s.tier.root is None
            del self.disk[entry]
        for m in plan.spills:
            tokens = list(self.s.tier.entries[m.entry].tokens)
            hs = prefix_hashes(tokens)
            assert [self.row.get(x) for x in m.rows] == hs, "a spill copies another prefix"
            assert self.ckpt.get(m.slot) == state_of(tokens), "a spill copies another state"
            self.disk[m.entry] = (hs, self.ckpt[m.slot])

    def fetches(self, plan: BatchPlan, failed: frozenset[int]) -> None:
        """Fetches land, last, in rows and a slot that nothing else holds."""
        in_tree = tree_ckpts(self.s)
        rows_in_tree = {x for n in self.s.cache._nodes() for x in n.value}
        for m in plan.fetches:
            hs, state = self.disk[m.entry]
            assert len(m.rows) == len(hs) and not set(m.rows) & rows_in_tree
            assert m.slot not in in_tree
            if m.entry not in failed:
                self.row.update(zip(m.rows, hs))
                self.ckpt[m.slot] = state
                self.num_fetches += 1

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
