"""Scheduling policy: admission, chunked prefill, continuous decode, checkpoint stores and loads.

No I/O here: ``schedule()`` turns the queue into one ``BatchPlan`` and ``process_result()`` turns
the ranks' sampled tokens into the step's ``TokenOut``s (one ``TokenBatch`` frame), so the whole
policy runs in tests without a model or a process.

Checkpoint boundaries of a request (only where the tree has no checkpoint yet) follow
``--checkpoint-admission`` (scheduler/admission.py); a prefill chunk always ends at the next one.
On finish the state after every processed token (prompt + output[:-1]) is cached too, so the
next turn of a conversation hits.

Prompt logprobs (echo): the cache holds states and KV, not logits, so a request that asks for
them matches nothing and prefills its whole prompt; its boundaries still store checkpoints.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace

from scheduler.admission import DEFAULT_CKPT_ADMISSION, check_admission, store_points
from scheduler.messages import (
    BatchPlan,
    Counters,
    LogitControls,
    Sample,
    SamplingParams,
    SeqStep,
    StepResult,
    TokenOut,
)
from scheduler.policy import SchedulePolicy, count_passes
from scheduler.pools import IndexPool
from scheduler.radix_cache import DEFAULT_CKPT_EVICTION, Node, RadixCache
from scheduler.request import Req
from scheduler.serve_config import LoadPolicy


def prefill_budget(tokens_per_s: float, step_target_ms: float, low: int = 64,
                   high: int = 8192) -> int:
    """New tokens per step so that a step's prefill takes about ``step_target_ms`` at the
    measured prefill rate: a multiple of 64 in [low, high].  Decodes share every step with the
    prefill chunks, so this bounds how long a decode waits behind a long prompt."""
    tokens = int(tokens_per_s * step_target_ms / 1000.0) // 64 * 64
    return min(high, max(low, tokens))


def active_state_slots(max_running_requests: int) -> int:
    """The ranks' active state pool: slot 0 reserved, one per request, one wr scratch each."""
    return 1 + 2 * max_running_requests


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_total_tokens: int  # KV rows (page size 1)
    max_running_requests: int  # active state slots
    num_checkpoint_slots: int
    max_context_len: int
    vocab_size: int
    eos_token_id: int | None = None
    chunked_prefill_size: int = 2048  # new tokens per step, decodes included
    checkpoint_interval: int = 256  # 0: prompt end only
    prefix_cache: bool = True
    cache_finished: bool = True
    load_policy: LoadPolicy = LoadPolicy.NR
    refresh_window: int = 0
    policy: SchedulePolicy = SchedulePolicy()  # which prefill a step takes first
    ckpt_eviction: str = DEFAULT_CKPT_EVICTION  # "reuse" | "lru" (RadixCache)
    ckpt_admission: str = DEFAULT_CKPT_ADMISSION  # "all" | "reuse" (scheduler.admission)

    @property
    def scratch_slot_base(self) -> int:
        """Active slots: 0 reserved, [1, 1 + R) requests, [1 + R, 1 + 2R) wr scratch."""
        return 1 + self.max_running_requests

    @property
    def num_state_slots(self) -> int:
        return active_state_slots(self.max_running_requests)


def _is_real(x: object) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        check_admission(cfg.ckpt_admission)
        self.cfg = cfg
        self.cache = RadixCache(IndexPool(cfg.max_total_tokens),
                                IndexPool(cfg.num_checkpoint_slots), cfg.ckpt_eviction)
        self.slots = IndexPool(cfg.max_running_requests, first=1)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._stores_before: list[tuple[int, int]] = []
        # (request, new tokens, sampled, prompt logprobs asked)
        self._inflight: list[tuple[Req, int, bool, bool]] = []
        self._new_tables: dict[str, Req] = {}  # row tables the next plan carries
        self._released: list[str] = []  # ended requests whose tables the next plan drops
        self._live: set[str] = set()  # ids of waiting and running requests
        self._step_id = 0
        self._decode_only_run = 0  # steps since the last that carried prefill (decode interleave)
        self._num_added = 0
        self._rng = random.Random(0)
        self._counters = Counters()  # the cache counts the evictions

    @property
    def stats(self) -> Counters:
        """A snapshot of the counters, the cache's evictions included."""
        return replace(self._counters, kv_evicted_rows=self.cache.num_kv_evicted,
                       checkpoints_evicted=self.cache.num_ckpt_evicted)

    # ---- requests in ----------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], sampling: SamplingParams) -> TokenOut | None:
        """Queue a request, or return the finished error frame that refuses it."""
        error = self._check(prompt, sampling)
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

    def _check(self, prompt: list[int], s: SamplingParams) -> str | None:
        cfg = self.cfg
        if not prompt:
            return "the prompt is empty"
        if any(not 0 <= t < cfg.vocab_size for t in prompt):
            return f"token ids must lie in [0, {cfg.vocab_size})"
        if s.max_tokens < 1:
            return "max_tokens must be at least 1"
        total = len(prompt) + s.max_tokens
        limit = min(cfg.max_context_len, cfg.max_total_tokens)
        if total > limit:
            return (f"prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) = {total} "
                    f"exceeds the limit of {limit} tokens")
        return self._check_controls(s) if s.has_logit_controls else None

    def _check_controls(self, s: SamplingParams) -> str | None:
        vocab = self.cfg.vocab_size
        if not isinstance(s.logit_bias, dict):
            return "logit_bias must map token ids to biases"
        for token, bias in s.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                return f"logit_bias token ids must lie in [0, {vocab}), got {token!r}"
            if not _is_real(bias) or not -100 <= bias <= 100:
                return f"logit_bias values must lie in [-100, 100], got {bias!r} for {token}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(s, name)
            if not _is_real(value) or not -2 <= value <= 2:
                return f"{name} must lie in [-2, 2], got {value!r}"
        if not _is_real(s.repetition_penalty) or not s.repetition_penalty > 0:
            return f"repetition_penalty must be a number > 0, got {s.repetition_penalty!r}"
        if not isinstance(s.min_tokens, int) or s.min_tokens < 0:
            return f"min_tokens must be at least 0, got {s.min_tokens!r}"
        if s.min_tokens > s.max_tokens:
            return f"min_tokens ({s.min_tokens}) must not exceed max_tokens ({s.max_tokens})"
        return None

    def abort(self, rid: str) -> bool:
        """Drop a request between steps (no step is in flight when this runs); False if it
        is not waiting or running.  No frame: the front end stops listening to a request
        before it asks for the abort."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                self._live.discard(rid)
                r.finish_reason = "abort"
                return True
        for r in self.running:
            if r.rid == rid:
                self._finish(r, "abort")
                return True
        return False

    def flush(self) -> None:
        self.cache.flush()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._stores_before)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        plan = BatchPlan(self._next_step_id(), stores_before=self._stores_before)
        self._stores_before, self._inflight = [], []
        budget = self.cfg.chunked_prefill_size
        for r in self.running:
            if not r.is_prefilling:
                self._add_seq(plan, r, r.computed + 1)
                budget -= 1
        ckpt_locked = []
        if self.cfg.policy.takes_prefill(bool(plan.seqs), self._decode_only_run):
            ckpt_locked = self._add_prefills(plan, budget)
        has_prefill = any(r.is_prefilling for r, _, _, _ in self._inflight)
        self._decode_only_run = 0 if has_prefill else self._decode_only_run + 1
        for r, n, _, _ in self._inflight:  # after every match: stores never feed this step's loads
            if r.is_prefilling:
                self._plan_store(plan, r, r.computed + n)
        for node in ckpt_locked:
            self.cache.unlock_ckpt(node)
        if not plan.seqs and not plan.stores_before:
            return None
        plan.release, self._released = self._released, []
        plan.tables = {rid: r.rows for rid, r in self._new_tables.items()}
        self._new_tables = {}
        return plan

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _add_prefills(self, plan: BatchPlan, budget: int) -> list[Node]:
        """Offer the step's budget to the prefill candidates in the policy's order: admitted
        requests take their next chunk, waiting ones are admitted first (after the first that
        does not fit, no other is).  Returns the nodes whose checkpoints this step loads."""
        policy = self.cfg.policy
        prefilling = [r for r in self.running if r.is_prefilling]
        remaining: dict[str, int] = {}

        def remaining_of(r: Req) -> int:
            if r.rid not in remaining:
                remaining[r.rid] = self._remaining_prefill(r)
            return remaining[r.rid]

        served, skipped, ckpt_locked = [], [], []
        longest, can_admit = 0, True
        for r in policy.order(prefilling, self.waiting, remaining_of):
            is_admitted = r.slot != 0
            if (budget <= 0 or (not is_admitted and not can_admit)
                    or (longest and policy.can_defer
                        and policy.defers(r, min(remaining_of(r), budget), longest))):
                skipped.append(r)
                continue
            if not is_admitted:
                if not self._admit(r, plan):
                    can_admit = False
                    skipped.append(r)
                    continue
                self.waiting.remove(r)
                self.running.append(r)
                if r.hit_len:
                    ckpt_locked.append(r.node)
            taken = self._add_chunk(plan, r, budget)
            budget -= taken
            longest = max(longest, taken)
            served.append(r)
        count_passes(skipped, served)
        return ckpt_locked

    def _can_hit(self, r: Req) -> bool:
        return self.cfg.prefix_cache and not r.sampling.prompt_logprobs

    def _remaining_prefill(self, r: Req) -> int:
        """Prompt tokens left to compute; for a waiting request, after the hit it would get."""
        if r.slot != 0:
            return len(r.prompt) - r.computed
        if not self._can_hit(r):
            return len(r.prompt)
        return len(r.prompt) - self.cache.match_len(r.prompt, len(r.prompt) - 1)

    def _admit(self, r: Req, plan: BatchPlan) -> bool:
        """Match the prompt, lock the hit, reserve KV rows and an active slot."""
        if self.slots.num_free == 0:
            return False
        cache = self.cache
        hit = cache.match(r.prompt, len(r.prompt) - 1) if self._can_hit(r) else cache.match([], 0)
        cache.lock(hit.node)
        rows = cache.alloc_rows(r.max_processed - hit.length)
        if rows is None:
            cache.unlock(hit.node)
            return False
        r.slot = self.slots.alloc(1)[0]
        r.node, r.rows, r.cached_len = hit.node, hit.kv_rows + rows, hit.length
        self._new_tables[r.rid] = r
        r.computed = r.hit_len = hit.length
        self._counters.prompt_tokens += len(r.prompt)
        self._counters.cached_tokens += hit.length
        if hit.length:
            cache.lock_ckpt(hit.node)
            plan.loads.append((hit.node.ckpt, r.slot))
            self._plan_refresh(plan, r)
        return True

    def _plan_refresh(self, plan: BatchPlan, r: Req) -> None:
        """dasc-wr: replay the last W_wr tokens before the hit into a zero scratch slot."""
        window = self.cfg.refresh_window
        if self.cfg.load_policy != LoadPolicy.WR or window <= 0:
            self._counters.loads_nr += 1
            return
        end = r.computed
        start = max(0, end - window)
        plan.refresh.append(SeqStep(r.rid, r.prompt[start:end], start, r.slot))
        plan.refresh_scratch.append(self.cfg.scratch_slot_base + len(plan.refresh_scratch))
        self._counters.loads_wr += 1
        self._counters.refresh_tokens += end - start

    def _boundaries(self, r: Req) -> list[int]:
        if not self.cfg.prefix_cache:
            return []
        cfg = self.cfg
        return store_points(r.prompt, cfg.checkpoint_interval, cfg.ckpt_admission, self.cache)

    def _add_chunk(self, plan: BatchPlan, r: Req, budget: int) -> int:
        """Prefill up to ``budget`` tokens, ending at the next boundary that still needs a
        checkpoint; returns the tokens taken."""
        end = min(len(r.prompt), r.computed + budget)
        for b in self._boundaries(r):
            if r.computed < b < end and self.cache.ckpt_at(r.prompt[:b]) is None:
                end = b
                break
        self._add_seq(plan, r, end)
        return end - r.computed

    def _add_seq(self, plan: BatchPlan, r: Req, end: int) -> None:
        sample = None
        if end == len(r.prompt) + len(r.output):
            s = r.sampling
            sample = Sample(s.temperature, s.top_p, s.top_k, r.seed, len(r.output),
                            num_top_logprobs=s.top_logprobs)
            if not r.output and s.has_logit_controls:
                sample.controls = self._controls(r)
        step = SeqStep(r.rid, r.token_slice(r.computed, end), r.computed, r.slot, sample)
        if r.sampling.prompt_logprobs:  # the prompt tokens after this chunk's tokens
            step.logprob_targets = r.prompt[r.computed + 1 : min(end + 1, len(r.prompt))]
            step.num_top_targets = r.sampling.top_logprobs
        plan.seqs.append(step)
        self._inflight.append((r, end - r.computed, sample is not None,
                               bool(step.logprob_targets)))

    def _controls(self, r: Req) -> LogitControls:
        """What rank 0 keeps for the request; only ids inside the vocabulary are banned (a stop
        id outside it can never be sampled anyway)."""
        s, vocab, eos = r.sampling, self.cfg.vocab_size, self.cfg.eos_token_id
        banned = [t for t in s.stop_token_ids if 0 <= t < vocab]
        if eos is not None and not s.ignore_eos and eos not in banned:
            banned.append(eos)
        seen = sorted(set(r.prompt)) if s.repetition_penalty != 1.0 else []
        return LogitControls(dict(s.logit_bias), float(s.presence_penalty),
                             float(s.frequency_penalty), float(s.repetition_penalty),
                             s.min_tokens, banned if s.min_tokens else [], seen, s.grammar)

    def _plan_store(self, plan: BatchPlan, r: Req, end: int) -> None:
        if end not in self._boundaries(r) or self.cache.ckpt_at(r.prompt[:end]) is not None:
            return
        ckpt = self.cache.alloc_ckpt()
        if ckpt is not None:
            plan.stores_after.append((r.slot, ckpt))
            r.pending_store = (end, ckpt)

    # ---- results --------------------------------------------------------------------------------
    def process_result(self, result: StepResult) -> list[TokenOut]:
        outs: list[TokenOut] = []
        sampled = iter(zip(result.token_ids, result.logprobs, strict=True))
        tops = iter(zip(result.top_ids, result.top_logprobs, strict=True))
        targets = iter(zip(result.target_logprobs, result.target_top_ids,
                           result.target_top_logprobs, strict=True))
        for r, n, is_sampled, has_targets in self._inflight:
            r.computed += n
            if has_targets:
                lps, top_ids, top_lps = next(targets)
                r.prompt_logprobs += lps
                if r.sampling.top_logprobs:
                    r.prompt_top_ids += top_ids
                    r.prompt_top_logprobs += top_lps
            if r.pending_store is not None:
                end, ckpt = r.pending_store
                r.pending_store = None
                self._cache_prefix(r, end, ckpt)
            if not is_sampled:
                continue
            token, logprob = next(sampled)
            top_ids, top_logprobs = next(tops, ([], []))
            r.output.append(token)
            reason = self._finish_reason(r, token)
            out = TokenOut(r.rid, [token], [logprob], finished=reason is not None,
                           finish_reason=reason, prompt_tokens=len(r.prompt),
                           cached_tokens=r.hit_len)
            if r.sampling.top_logprobs:
                out.top_ids, out.top_logprobs = [top_ids], [top_logprobs]
            if r.sampling.prompt_logprobs and len(r.output) == 1:
                out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs = (
                    r.prompt_logprobs, r.prompt_top_ids, r.prompt_top_logprobs)
                r.prompt_logprobs, r.prompt_top_ids, r.prompt_top_logprobs = [], [], []
            outs.append(out)
            if reason is not None:
                self._finish(r, reason)
        self._inflight = []
        return outs

    def _finish_reason(self, r: Req, token: int) -> str | None:
        s = r.sampling
        if (token == self.cfg.eos_token_id and not s.ignore_eos) or token in s.stop_token_ids:
            return "stop"
        return "length" if len(r.output) >= s.max_tokens else None

    def _cache_prefix(self, r: Req, end: int, ckpt: int) -> bool:
        """Hand [0, end) of the request to the tree with a checkpoint at ``end``; the request
        keeps a lock on the new node and adopts the tree's rows.  False: the tree already had
        a checkpoint there and ``ckpt`` went back to the pool."""
        res = self.cache.insert(r.token_slice(0, end), r.rows[:end], ckpt)
        if res.ckpt_taken:
            self._counters.checkpoints_stored += 1
        else:
            self.cache.ckpt_pool.free([ckpt])
        if res.num_existing > r.cached_len:  # someone cached these tokens first: drop ours
            self.cache.kv_pool.free(r.rows[r.cached_len : res.num_existing])
            self._new_tables[r.rid] = r  # the ranks need the tree's rows instead
        self.cache.lock(res.node)
        self.cache.unlock(r.node)
        r.rows = res.kv_rows + r.rows[end:]
        r.node, r.cached_len = res.node, end
        return res.ckpt_taken

    def _finish(self, r: Req, reason: str) -> None:
        r.finish_reason = reason
        self.running.remove(r)
        cache = self.cache
        end = r.computed
        if (reason != "abort" and self.cfg.prefix_cache and self.cfg.cache_finished
                and end > r.cached_len and cache.ckpt_at(r.token_slice(0, end)) is None):
            ckpt = cache.alloc_ckpt()
            if ckpt is not None and self._cache_prefix(r, end, ckpt):
                # written at the start of the next step, before any load can read it
                self._stores_before.append((r.slot, ckpt))
        cache.kv_pool.free(r.own_rows)
        cache.unlock(r.node)
        self.slots.free([r.slot])
        r.node, r.rows = None, []
        self._new_tables.pop(r.rid, None)
        self._released.append(r.rid)
        self._live.discard(r.rid)

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every row and slot is free, cached in one node, or owned by one running request."""
        rows = [x for r in self.running for x in r.own_rows]
        ckpts = [r.pending_store[1] for r in self.running if r.pending_store is not None]
        self.cache.check_integrity(rows, ckpts, [r.node for r in self.running], [])
        held = [r.slot for r in self.running]
        assert len(held) == len(set(held)) and not set(held) & self.slots.free_ids()
        assert len(held) + self.slots.num_free == self.slots.size, "active slot leaked"
