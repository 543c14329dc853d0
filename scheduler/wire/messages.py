"""Typed messages between the three roles: front end <-> scheduler <-> rank 0 (-> other ranks).

Plain dataclasses of ints, floats, strings and lists; no torch, so every role imports them.
``scheduler.wire.ipc`` moves them over ``multiprocessing.connection`` and refuses to decode anything
that is not one of these classes (or a builtin container of scalars).

The scheduler <-> rank messages live in ``scheduler.wire.rank_messages``.

Flow of one request: GenerateReq (front end) -> the scheduler plans BatchPlans -> rank 0 returns
a StepResult per plan -> the scheduler sends one TokenBatch per step to the front end, holding a
TokenOut for each request that got tokens, until the request's finished one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from scheduler.wire.rank_messages import (
    BatchPlan,
    LogitControls,
    RankInfo,
    Sample,
    SeqStep,
    StepResult,
    TierMove,
)
from scheduler.wire.serve_config import (
    CONFIG_TYPES,
    LoadPolicy,
    ServeConfig,
)

# ---- front end -> scheduler --------------------------------------------------------------------


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: the scheduler draws one
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after one of these
    ignore_eos: bool = False
    # logit controls (OpenAI / vLLM semantics; the defaults are off and cost nothing)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    presence_penalty: float = 0.0  # [-2, 2], over the generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and generated tokens; 1 = off
    min_tokens: int = 0  # EOS and stop_token_ids banned before this many tokens
    top_logprobs: int = 0  # the likeliest tokens reported with each sampled one (0: none)
    logprobs: bool = True  # each sampled token's logprob is reported (False: not computed)
    # echo: also the logprobs (and ``top_logprobs`` likeliest) of prompt tokens [1, n); such a
    # request prefills its whole prompt (the cache keeps no logits), storing checkpoints still
    prompt_logprobs: bool = False
    # structured output: an llguidance grammar (``LLMatcher.grammar_from_*``, serialised) the
    # output must match; rank 0 masks every token it disallows ("" = none)
    grammar: str = ""

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.grammar)


@dataclass(slots=True)
class GenerateReq:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class AbortReq:
    rid: str


@dataclass(slots=True)
class FlushCacheReq:
    pass


@dataclass(slots=True)
class StatsReq:
    pass


@dataclass(slots=True)
class Shutdown:
    """Sent by the launcher to the scheduler, and by the scheduler to the ranks."""


# ---- scheduler -> front end --------------------------------------------------------------------


@dataclass(slots=True)
class TokenOut:
    """New tokens of one request since its previous TokenOut; the last one has ``finished``."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # one per token, model distribution
    # one per token when the request asks for top logprobs (else empty): the likeliest
    # ``SamplingParams.top_logprobs`` tokens and their logprobs, most likely first
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # with ``SamplingParams.prompt_logprobs``, on the first frame only: the logprobs of prompt
    # tokens [1, n) and (``top_logprobs`` > 0) their top ids / logprobs, as the fields above
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": why the request was refused


@dataclass(slots=True)
class TokenBatch:
    """One frame per step, not per token: a TokenOut for every request the step sampled for
    (or, alone, the finished one that refuses a request), in plan order."""

    outs: list[TokenOut]


@dataclass(slots=True)
class FlushCacheDone:
    ok: bool
    message: str


@dataclass(slots=True)
class Counters:
    """The scheduler's counters since start-up (``/v1/stats``' ``counters``)."""

    prompt_tokens: int = 0  # admitted
    cached_tokens: int = 0  # of those, restored from the prefix cache
    loads_nr: int = 0  # checkpoint hits with the omitted units zero-filled
    loads_wr: int = 0  # checkpoint hits with a dasc-wr refresh
    parked_hits: int = 0  # hits that adopted a finished request's parked slot (exact, no load)
    refresh_tokens: int = 0  # tokens those refreshes replayed
    # every checkpoint the tree took, at a prefill boundary or when a request finished; minus
    # checkpoints_evicted it is always the number cached
    checkpoints_stored: int = 0
    kv_evicted_rows: int = 0
    checkpoints_evicted: int = 0
    screened_tokens: int = 0  # greedy tokens the screened LM head gave (``--cpu-lm-head-screen``)

    def loads(self, policy: LoadPolicy) -> int:
        return self.loads_wr if policy is LoadPolicy.WR else self.loads_nr


@dataclass(slots=True)
class TierStats:
    """The second cache tier (``/v1/stats``' ``tier``; None without ``--cache-tier-dir``)."""

    directory: str
    budget_bytes: int
    entries: int = 0  # on disk, every rank's file written
    bytes: int = 0  # theirs and the writes in flight
    restored: int = 0  # entries found at start-up
    spills: int = 0  # entries written
    spill_bytes: int = 0
    spill_failed: int = 0
    fetches: int = 0  # entries read back into the pools (tier-2 hits)
    fetch_bytes: int = 0
    fetch_s: float = 0.0  # rank 0's time reading them
    fetch_failed: int = 0  # dropped: a check failed on load
    evicted: int = 0  # dropped for the byte budget


@dataclass(slots=True)
class Stats:
    """Scheduler counters and pool occupancy; ``integrity`` is the result of a fresh
    ``check_integrity`` ("ok" or the failed assertion)."""

    kv_rows_total: int
    kv_rows_free: int
    kv_rows_cached: int
    checkpoint_slots_total: int
    checkpoint_slots_free: int
    checkpoint_slots_cached: int
    num_running: int
    num_waiting: int
    counters: Counters
    num_steps: int
    step_s: float  # scheduler wall time of all steps: plan, IPC, ranks, results out
    compute_s: float  # rank 0's share of it
    integrity: str
    tier: TierStats | None = None


@dataclass(slots=True)
class ServerInfo:
    """What the scheduler tells the front end once the ranks are up: the config every process
    runs, rank 0's report, and the prefill budget the scheduler derived from them."""

    config: ServeConfig
    rank: RankInfo
    chunked_prefill_size: int  # new tokens per step, as configured or derived

    @property
    def arm(self) -> str:
        return self.config.checkpoints.arm

    def as_json(self) -> dict:
        """The engine's facts, flat, as ``/server_info`` has always reported them."""
        ckpt, sched = self.config.checkpoints, self.config.scheduling
        return {"model": self.config.model, **asdict(self.rank),
                "max_total_tokens": sched.max_total_tokens,
                "max_running_requests": sched.max_running_requests,
                "prefix_cache": sched.prefix_cache,
                "park_finished": sched.prefix_cache and sched.cache_finished
                and sched.park_finished,
                "chunked_prefill_size": self.chunked_prefill_size, "w_max": ckpt.w_max,
                "load_policy": str(ckpt.load_policy), "checkpoint_format": ckpt.format,
                "arm": ckpt.arm, "cache_tier_dir": self.config.tier.cache_tier_dir}


MESSAGE_TYPES = (
    SamplingParams, GenerateReq, AbortReq, FlushCacheReq, StatsReq, Shutdown, TokenOut,
    TokenBatch, FlushCacheDone, Counters, Stats, TierStats, TierMove,
    ServerInfo, RankInfo, LogitControls, Sample, SeqStep, BatchPlan, StepResult,
    *CONFIG_TYPES,  # the serving config, inside ServerInfo
)
