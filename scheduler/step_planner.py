"""One step's plan: decodes of the running requests, then prefill chunks in the policy's order
(admitting waiting requests as KV rows and slots allow), checkpoint loads for their hits,
dasc-wr refreshes, and checkpoint stores at chunk ends.

A chunk runs through the prompt's end minus one (where every prompt stores): the ranks snapshot
the state there into a scratch slot (``SeqStep.snapshots``) and the store reads that slot after
the forward, so the first token is sampled in the step that stores.  The scratch slot is the one
paired with the request's active slot, shared with its dasc-wr replay (each linear layer writes
snapshots after its merge read the replay), so one per request always exists.

The step's first prefill in the policy's order (the only one when it prefills alone) runs
through the store points inside it (``--checkpoint-interval``), each cut into a checkpoint slot
(one is kept for the chunk's end store) and a scratch slot (its own, then any other that no
other sequence of the step uses, settled once the whole step is planned: another prefill's
end-of-prompt snapshot and a dasc-wr replay take their own); the chunk ends at the first point
without them.  Its cuts take the free slots, and a full pool evicts for them too while the
step's cuts stay under a quarter of the pool (``FULL_POOL_CUT_SHARE``): point by point, a cold
1,400-token prompt took a step per interval under a full pool, six forwards where one does (3.0
against 2.6 s at Qwen3.5-0.8B's shape); the eviction sim over five seeds lost up to 3.4 points
of hit rate at 8-32 slots and kept it within 0.2 or raised it from 48 on, with up to a third
fewer chunks; evicting for more in one step drops checkpoints that hits between those steps
would have kept (docs/results/serving.md, "A full pool's cuts").  Any other prefill's chunk ends
at its next point, and a full pool evicts for one store at a time, each after the previous one
is in the tree.  Except at an interval point in the last half interval of a short remainder (a
conversation's next turn, an agent's new message: ``_passes``): a chunk that reaches the end
runs past it unstored rather than cost the prompt another step, the end's checkpoint a few
tokens on.  So prompts after the first advance point by point, breadth first: cutting through
every point of several prompts, evicting for several stores in one step, cost the multi-turn
eviction sim up to 15 points of hit rate (docs/results/serving.md, a chunk runs through the
store points inside it).  A shorter prompt finishes first: the first prefill cuts through, and
the others' chunks end at their next point.  Except where that first one would finish and leave
another prompt of the step no more tokens than it took itself (prompts of a size, sent
together): the other's remainder would then fill the first one's first decode step, its stream
stalling a whole prefill step right after its first token.  Those prefills share the step's
budget instead, each cutting through its points while the step's cut room (above) and scratch
slots last, and finish in the same step (``_share``).  Two cold 1,400-token prompts sent together
at Qwen3.5-0.8B's shape on the 2-core VM took 3.2-3.7 s and 6.1-6.3 s first one first, the first
one's first decode waiting ~2.4-3 s behind the other; point by point both took 5.8 s.  A cut
whose store finds no checkpoint slot is dropped before the step is sent.

While requests decode, a step's prefill may wait: ``--decode-interleave`` runs N decode-only steps
between prefill steps, ``--decode-first cost`` defers prefill while the running decodes should
finish first by the ranks' measured step times (scheduler/step_costs.py).

Checkpoint boundaries of a request (only where the tree has no checkpoint yet) follow
``--checkpoint-admission`` (scheduler/admission.py).

Prefixes shared in flight: a waiting request that shares a prefix with a prefill in flight or
ahead of it in the queue (at least ``MIN_BRANCH_GAIN`` tokens past its own hit) is a follower:
it waits while that leader prefills up to the prefix they share, and the leader stores a
checkpoint where their prompts part, so the follower then hits there and prefills only its own
suffix.  Without it, requests that arrive together with one system prompt each prefilled the
whole of it at the same time, sharing the compute, and none hit.  So a shared prefix is hit
from its second sharer on when the sharers are in flight together (the third when the first
has finished: its path is then in the tree, and the second stores the branch point).

Prompt logprobs (echo): the cache holds states and KV, not logits, so a request that asks for
them matches nothing and prefills its whole prompt; its boundaries still store checkpoints.
"""

from __future__ import annotations

from itertools import islice
from typing import NamedTuple

from scheduler.admission import MIN_BRANCH_GAIN, store_points
from scheduler.cache_tier import TierEntry
from scheduler.policy import LPM_MAX_RANKED, SchedulePolicy, count_passes
from scheduler.radix_cache import Node
from scheduler.request import Req
from scheduler.request_table import RequestTable
from scheduler.step_costs import StepCosts
from scheduler.wire.rank_messages import BatchPlan, LogitControls, Sample, SeqStep, TierMove
from scheduler.wire.serve_config import DecodeFirst, LoadPolicy

# A step's cuts inside prompts may take the free checkpoint slots, or up to 1 / this of the pool
# where fewer are free (evicting for the rest), less one for the chunk's end store: the module
# docstring.
FULL_POOL_CUT_SHARE = 4


class InFlight(NamedTuple):
    """One sequence of the plan in flight, as its result is read back."""

    req: Req
    num_tokens: int  # new tokens the step computes
    is_sampled: bool
    has_targets: bool  # prompt logprobs asked for this chunk
    step: SeqStep  # as sent (its snapshots: the stores read them)


class StepPlanner:
    def __init__(self, table: RequestTable):
        self.cfg, self.limits, self.table = table.cfg, table.limits, table
        self.policy = SchedulePolicy(table.cfg)
        self._inflight: list[InFlight] = []  # the plan in flight's sequences, in plan order
        self._step_id = 0
        self._decode_only_run = 0  # steps since the last that carried prefill (decode interleave)
        self._cut_room = 0  # cuts inside prompts left to this step (the first prefill's, or
        # the prefills' that share the step: ``_share``)
        self._cutters: list[int] = []  # plan indices of the chunks that cut more than once
        self.costs = StepCosts()  # the ranks' step times, for --decode-first cost
        self._prefill_tokens = 0  # prefill tokens of the step in flight
        self._remaining: dict[str, int] = {}  # this step's _remaining_prefill, by rid
        self._followers: set[str] = set()  # this step's waiting followers, by rid
        self._share_points: dict[str, set[int]] = {}  # a leader's points its followers need
        self._fetches: list[tuple[TierMove, TierEntry]] = []  # its second-tier fetches

    def schedule(self) -> BatchPlan | None:
        """The next step; None when there is nothing to run.  An admission that fails after
        its eviction freed rows (the hit it locked kept the rest) is tried again, so a step is
        planned whenever the freed rows now let one run."""
        while True:
            free = self.table.cache.kv_pool.num_free
            plan = self._plan_step()
            if plan is not None or self.table.cache.kv_pool.num_free == free:
                return plan

    def _plan_step(self) -> BatchPlan | None:
        table = self.table
        # the stores stay listed in the table until the plan is whole: their slots do not
        # hold the states yet, so an eviction while planning must not spill them
        plan = BatchPlan(self.next_step_id(), stores_before=list(table.stores_before))
        self._inflight = []
        self._remaining = {}
        self._find_followers()
        pool = table.cache.ckpt_pool
        self._cut_room = max(pool.num_free, pool.size // FULL_POOL_CUT_SHARE, 1) - 1
        self._cutters = []
        budget = self.cfg.chunk_tokens
        decoding = [r for r in table.running if not r.is_prefilling]
        for r in decoding:
            self._add_seq(plan, r, r.computed + 1)
        budget -= len(decoding)
        ckpt_locked = []
        if (self.policy.takes_prefill(bool(plan.seqs), self._decode_only_run)
                and not self._decodes_first(decoding, budget)):
            ckpt_locked = self._add_prefills(plan, budget)
            self._settle_cuts(plan)
        self._prefill_tokens = sum(f.num_tokens for f in self._inflight if f.req.is_prefilling)
        has_prefill = self._prefill_tokens > 0
        self._decode_only_run = 0 if has_prefill else self._decode_only_run + 1
        # stores are planned after every match, so they never feed this step's loads
        for f in self._inflight:
            r = f.req
            if not r.is_prefilling:
                continue
            f.step.snapshots = [(cut, slot) for cut, slot in f.step.snapshots
                                if self._plan_store(plan, r, r.computed + cut, slot)]
            self._plan_store(plan, r, r.computed + f.num_tokens, r.slot)
        for node in ckpt_locked:
            table.cache.unlock_ckpt(node)
        if not plan.seqs and not plan.stores_before and not plan.fetches:
            return None
        table.stores_before = []
        plan.release, plan.tables = table.take_table_changes()
        return plan

    def step_done(self, compute_s: float
                  ) -> tuple[list[InFlight], list[tuple[TierMove, TierEntry]]]:
        """The plan in flight's sequences and tier fetches, handed over once its result is
        back (the planner keeps neither); ``compute_s``, the ranks' time for it, feeds the
        step costs."""
        if self._inflight:
            self.costs.observe(len(self._inflight), self._prefill_tokens, compute_s)
        done = self._inflight, self._fetches
        self._inflight, self._fetches = [], []
        return done

    @property
    def fetch_moves(self) -> list[TierMove]:
        """The plan in flight's second-tier fetches (their rows and slots are taken)."""
        return [move for move, _ in self._fetches]

    def _decodes_first(self, decoding: list[Req], budget: int) -> bool:
        """``--decode-first cost``: whether this step leaves its prefill out, by the step
        costs' rule over the prefill it would take (up to ``budget`` tokens)."""
        if self.cfg.decode_first is not DecodeFirst.COST or not decoding or budget <= 0:
            return False
        table = self.table
        prefilling = [r for r in table.running if r.is_prefilling]
        tokens = 0
        for r in prefilling + list(islice(table.waiting, LPM_MAX_RANKED)):  # as lpm ranks
            tokens += self._remaining_prefill(r)  # memoised: _add_prefills reads it again
            if tokens >= budget:
                break
        left = max(r.sampling.max_tokens - len(r.output) for r in decoding)
        return self.costs.defers(len(decoding), left, len(prefilling) + len(table.waiting),
                                 min(tokens, budget))

    def next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _add_prefills(self, plan: BatchPlan, budget: int) -> list[Node]:
        """Offer the step's budget to the prefill candidates in the policy's order: admitted
        requests take their next chunk, waiting ones are admitted first (after the first that
        does not fit, no other is).  Returns the nodes whose checkpoints this step loads."""
        policy, table = self.policy, self.table
        prefilling = [r for r in table.running if r.is_prefilling]
        remaining_of = self._remaining_prefill
        served, skipped, ckpt_locked = [], [], []
        longest, can_admit = 0, True
        offered, room, chunks = budget, self._cut_room, []  # chunks: (request, tokens taken)
        waiting = [r for r in table.waiting if r.rid not in self._followers]
        for r in policy.order(prefilling, waiting, remaining_of):
            is_admitted = r.slot != 0
            if (budget <= 0 or (not is_admitted and not can_admit)
                    or (longest and policy.can_defer
                        and policy.defers(r, min(remaining_of(r), budget), longest))):
                skipped.append(r)
                continue
            if not is_admitted:
                if self._plan_fetch(r, plan):
                    skipped.append(r)  # admitted next step, as a hit on what it fetches
                    continue
                if not self._admit(r, plan, ckpt_locked):
                    can_admit = False
                    skipped.append(r)
                    continue
                table.waiting.remove(r)
                table.running.append(r)
            taken = self._add_chunk(plan, r, budget)
            self._cut_room = 0  # the step's first prefill took the cuts
            budget -= taken
            longest = max(longest, taken)
            served.append(r)
            chunks.append((r, taken))
        if len(chunks) > 1 and _left(*chunks[0]) == 0 and any(
                0 < _left(r, taken) <= chunks[0][1] for r, taken in chunks[1:]):
            self._share(plan, [r for r, _ in chunks], offered, room)
        count_passes(skipped, served)
        return ckpt_locked

    def _share(self, plan: BatchPlan, reqs: list[Req], budget: int, room: int) -> None:
        """Prompts of a size sent together (the module docstring): the step's prefills, the
        plan's last sequences, rebuilt to share ``budget`` in turn (each the rest over those
        left, so a shorter one's unused share goes to the later ones), each cutting through
        its store points while the ``room`` checkpoint slots last (less one for each
        chunk's end store)."""
        start = len(plan.seqs) - len(reqs)
        del plan.seqs[start:], self._inflight[start:]
        self._cutters = [i for i in self._cutters if i < start]
        self._cut_room = max(0, room - len(reqs) + 1)
        for k, r in enumerate(reqs):
            budget -= self._add_chunk(plan, r, budget // (len(reqs) - k))

    def _can_hit(self, r: Req) -> bool:
        return self.cfg.prefix_cache and not r.sampling.prompt_logprobs

    def _find_followers(self) -> None:
        """This step's followers and their leaders' share points (the module docstring).
        Leaders: the prefills in flight, then the waiting requests in arrival order that
        follow nobody (the first ``LPM_MAX_RANKED`` of them, as the policy ranks).  A
        follower waits for the deepest point it will hit: the share point where a checkpoint
        there gains ``MIN_BRANCH_GAIN`` tokens over the leader's own store points and the
        tree's checkpoints below it (never under ``--checkpoint-admission all``), else that
        deepest one."""
        self._followers, self._share_points = set(), {}
        if not self.cfg.prefix_cache:
            return
        leaders = [r for r in self.table.running if r.is_prefilling]
        points: dict[str, list[int]] = {}
        for w in islice(self.table.waiting, LPM_MAX_RANKED):
            if not self._can_hit(w):
                leaders.append(w)
                continue
            hit = len(w.prompt) - self._remaining_prefill(w)
            best, leader, share = hit + MIN_BRANCH_GAIN - 1, None, False
            for r in leaders:
                shared = _common_prefix(w.prompt, r.prompt, len(w.prompt) - 1)
                if shared <= max(best, r.computed):  # no point it could wait for
                    continue
                if r.rid not in points:  # the leader's own, before this step's share points
                    points[r.rid] = self._boundaries(r)
                below = max([hit, self.table.cache.match_len(r.prompt, shared),
                             *(p for p in points[r.rid] if p <= shared),
                             *(p for p in self._share_points.get(r.rid, ()) if p <= shared)])
                stores = (self.cfg.checkpoint_admission != "all"
                          and shared - below >= MIN_BRANCH_GAIN)
                point = shared if stores else below
                if point > max(best, r.computed):
                    best, leader, share = point, r, stores
            if leader is None:
                leaders.append(w)
                continue
            self._followers.add(w.rid)
            if share:
                self._share_points.setdefault(leader.rid, set()).add(best)

    def _remaining_prefill(self, r: Req) -> int:
        """Prompt tokens left to compute; for a waiting request, after the hit it would get
        (a prefix match, so memoised for the step being planned)."""
        if r.rid not in self._remaining:
            if r.slot != 0:
                left = len(r.prompt) - r.computed
            elif not self._can_hit(r):
                left = len(r.prompt)
            else:
                left = len(r.prompt) - self.table.cache.match_len(r.prompt, len(r.prompt) - 1)
            self._remaining[r.rid] = left
        return self._remaining[r.rid]

    def _plan_fetch(self, r: Req, plan: BatchPlan) -> bool:
        """Whether the second tier holds a prefix of ``r``'s prompt ``MIN_BRANCH_GAIN`` tokens
        deeper than the radix cache does, and this step reads it back into fresh KV rows and
        a checkpoint slot (another request fetching the same entry waits for it too)."""
        tier, cache = self.table.tier, self.table.cache
        if tier is None or not self._can_hit(r):
            return False
        max_len = len(r.prompt) - 1
        entry = tier.deepest(r.prompt, max_len)
        if entry is None or len(entry.tokens) < cache.match_len(r.prompt, max_len) + \
                MIN_BRANCH_GAIN:
            return False
        if any(e is entry for _, e in self._fetches):
            return True
        tier.start_fetch(entry)  # not evicted by the spills these allocations may cause
        rows = cache.alloc_rows(len(entry.tokens))
        slot = cache.alloc_ckpt() if rows is not None else None
        if slot is None:
            if rows is not None:
                cache.kv_pool.free(rows)
            entry.fetching -= 1
            return False
        move = TierMove(entry.id, slot, rows)
        plan.fetches.append(move)
        self._fetches.append((move, entry))
        return True

    def _admit(self, r: Req, plan: BatchPlan, ckpt_locked: list[Node]) -> bool:
        """Match the prompt, lock the hit, reserve KV rows and an active slot: the hit's
        parked slot if it has one (adopted as it is), else a free one (dropping the oldest
        parked slot when none is free).  A checkpoint the plan loads is locked and listed in
        ``ckpt_locked``."""
        table = self.table
        cache = table.cache
        if table.slots.num_free == 0 and cache.num_parked == 0:
            return False
        hit = cache.match(r.prompt, len(r.prompt) - 1) if self._can_hit(r) else cache.match([], 0)
        adopt = hit.node.parked is not None
        if not adopt and table.slots.num_free == 0 and not cache.drop_parked(1):
            return False
        cache.lock(hit.node)
        rows = cache.alloc_rows(r.max_processed - hit.length)
        if rows is None:
            cache.unlock(hit.node)
            return False
        r.slot = cache.unpark(hit.node) if adopt else table.slots.alloc(1)[0]
        r.node, r.rows, r.cached_len = hit.node, hit.kv_rows + rows, hit.length
        table.new_tables[r.rid] = r
        r.computed = r.hit_len = hit.length
        counters = table.counters
        counters.prompt_tokens += len(r.prompt)
        counters.cached_tokens += hit.length
        if adopt:
            counters.parked_hits += 1
        elif hit.length:
            cache.lock_ckpt(hit.node)
            ckpt_locked.append(hit.node)
            plan.loads.append((hit.node.ckpt, r.slot))
            self._plan_refresh(plan, r)
        return True

    def _plan_refresh(self, plan: BatchPlan, r: Req) -> None:
        """dasc-wr: replay the last W_wr tokens before the hit into a zero scratch slot."""
        window, counters = self.limits.refresh_window, self.table.counters
        if self.limits.load_policy != LoadPolicy.WR or window <= 0:
            counters.loads_nr += 1
            return
        end = r.computed
        start = max(0, end - window)
        plan.refresh.append(SeqStep(r.rid, r.prompt[start:end], start, r.slot))
        plan.refresh_scratch.append(self._scratch_slot(r))
        counters.loads_wr += 1
        counters.refresh_tokens += end - start

    def _boundaries(self, r: Req) -> list[int]:
        if not self.cfg.prefix_cache:
            return []
        cfg = self.cfg
        points = store_points(r.prompt, cfg.checkpoint_interval, cfg.checkpoint_admission,
                              self.table.cache)
        shared = self._share_points.get(r.rid)
        return sorted(shared.union(points)) if shared else points

    def _scratch_slot(self, r: Req) -> int:
        """The scratch slot paired with ``r``'s active slot: its replay's and its first cut's."""
        return self.cfg.scratch_slot_base + r.slot - 1

    def _add_chunk(self, plan: BatchPlan, r: Req, budget: int) -> int:
        """Prefill up to ``budget`` tokens, cut at the store points inside that still need a
        checkpoint, as far as the module docstring allows; returns the tokens taken."""
        end = min(len(r.prompt), r.computed + budget)
        cuts = [b - r.computed for b in self._boundaries(r)
                if r.computed < b < end and self.table.cache.ckpt_at(r.prompt[:b]) is None]
        inside = [c for c in cuts if r.computed + c < len(r.prompt) - 1]
        if len(inside) > self._cut_room:
            left = inside[self._cut_room :]
            if end == len(r.prompt) and all(self._passes(r, r.computed + c) for c in left):
                cuts = [c for c in cuts if c not in left]  # finish; those points go unstored
            else:
                end, cuts = r.computed + left[0], inside[: self._cut_room]
        own, base = self._scratch_slot(r), self.cfg.scratch_slot_base
        num_scratch = self.cfg.max_running_requests
        slots = [own] + [x for x in range(base, base + num_scratch) if x != own]
        if len(cuts) > num_scratch:
            end, cuts = r.computed + cuts[num_scratch], cuts[:num_scratch]
        self._cut_room -= len([c for c in cuts if r.computed + c < len(r.prompt) - 1])
        if len(cuts) > 1:  # more than its own scratch slot: settled once the step is planned
            self._cutters.append(len(plan.seqs))
        self._add_seq(plan, r, end, list(zip(cuts, slots)))
        return end - r.computed

    def _passes(self, r: Req, point: int) -> bool:
        """Whether a chunk that reaches the prompt's end runs past this store point rather than
        stop there without a cut for it: an interval point in the last half interval of a
        short remainder (fewer than an interval of tokens past the request's hit: a
        conversation's next turn, an agent's new message), neither where a prompt in flight
        parts from this one nor where this one leaves the tree.  The end's checkpoint, a few
        tokens on, covers every later prompt but one that branches in between, which then
        hits at most an interval earlier; stopping would cost the prompt another step."""
        interval, n = self.cfg.checkpoint_interval, len(r.prompt)
        return (interval > 0 and point % interval == 0 and n - r.hit_len <= interval
                and n - 1 - point < interval // 2
                and point not in self._share_points.get(r.rid, ())
                and point != self.table.cache.cached_len(r.prompt))

    def _settle_cuts(self, plan: BatchPlan) -> None:
        """Give the cutting chunks the scratch slots no other sequence of the step uses, each
        its own first (the others' end-of-prompt snapshots and dasc-wr replays take theirs),
        then the spare ones in plan order; a chunk ends at its first cut left without one."""
        if not self._cutters:
            return
        cutting = set(self._cutters)
        used = {slot for i, q in enumerate(plan.seqs) if i not in cutting
                for _, slot in q.snapshots}
        used.update(plan.refresh_scratch)
        used.update(self._scratch_slot(self._inflight[i].req) for i in self._cutters)
        base = self.cfg.scratch_slot_base
        spare = [x for x in range(base, base + self.cfg.max_running_requests) if x not in used]
        for i in self._cutters:
            f = self._inflight[i]
            r, cuts = f.req, [c for c, _ in f.step.snapshots]
            slots = [self._scratch_slot(r)] + spare[: len(cuts) - 1]
            spare = spare[len(slots) - 1 :]
            if len(cuts) <= len(slots):
                f.step.snapshots = list(zip(cuts, slots))
                continue
            del plan.seqs[i], self._inflight[i]  # rebuilt shorter, in its place
            self._add_seq(plan, r, r.computed + cuts[len(slots)], list(zip(cuts, slots)))
            plan.seqs.insert(i, plan.seqs.pop())
            self._inflight.insert(i, self._inflight.pop())

    def _add_seq(self, plan: BatchPlan, r: Req, end: int,
                 snapshots: list[tuple[int, int]] | None = None) -> None:
        sample = None
        if end == len(r.prompt) + len(r.output):
            s = r.sampling
            sample = Sample(s.temperature, s.top_p, s.top_k, r.seed, len(r.output),
                            num_top_logprobs=s.top_logprobs, logprob=s.logprobs)
            if not r.output and s.has_logit_controls:
                sample.controls = self._controls(r)
        step = SeqStep(r.rid, r.token_slice(r.computed, end), r.computed, r.slot, sample,
                       snapshots=snapshots or [])
        if r.sampling.prompt_logprobs:  # the prompt tokens after this chunk's tokens
            step.logprob_targets = r.prompt[r.computed + 1 : min(end + 1, len(r.prompt))]
            step.num_top_targets = r.sampling.top_logprobs
        plan.seqs.append(step)
        self._inflight.append(InFlight(r, end - r.computed, sample is not None,
                                      bool(step.logprob_targets), step))

    def _controls(self, r: Req) -> LogitControls:
        """What rank 0 keeps for the request; only ids inside the vocabulary are banned (a stop
        id outside it can never be sampled anyway)."""
        s, vocab, eos = r.sampling, self.limits.vocab_size, self.limits.eos_token_id
        banned = [t for t in s.stop_token_ids if 0 <= t < vocab]
        if eos is not None and not s.ignore_eos and eos not in banned:
            banned.append(eos)
        seen = sorted(set(r.prompt)) if s.repetition_penalty != 1.0 else []
        return LogitControls(dict(s.logit_bias), float(s.presence_penalty),
                             float(s.frequency_penalty), float(s.repetition_penalty),
                             s.min_tokens, banned if s.min_tokens else [], seen, s.grammar)

    def _plan_store(self, plan: BatchPlan, r: Req, end: int, source: int) -> bool:
        """Store the state after prompt[:end], which the step leaves in slot ``source``;
        False when nothing is stored (not a store point, or no checkpoint slot)."""
        cache = self.table.cache
        if end not in self._boundaries(r) or cache.ckpt_at(r.prompt[:end]) is not None:
            return False
        ckpt = cache.alloc_ckpt()
        if ckpt is None:
            return False
        plan.stores_after.append((source, ckpt))
        r.pending_stores.append((end, ckpt))
        return True


def _left(r: Req, taken: int) -> int:
    """Prompt tokens ``r`` has left after a chunk of ``taken`` tokens."""
    return len(r.prompt) - r.computed - taken


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of a's and b's common prefix, at most ``limit`` (slice comparisons: a
    binary search of C-speed list compares, not a Python loop over tokens)."""
    lo, hi = 0, min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
