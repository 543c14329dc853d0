"""Typed messages between the three roles: front end <-> scheduler <-> rank 0 (-> other ranks).

Plain dataclasses of ints, floats, strings and lists; no torch, so every role imports them.
``scheduler.ipc`` moves them over ``multiprocessing.connection`` and refuses to decode anything
that is not one of these classes (or a builtin container of scalars).

Flow of one request: GenerateReq (front end) -> the scheduler plans BatchPlans -> rank 0 returns
a StepResult per plan -> the scheduler sends one TokenBatch per step to the front end, holding a
TokenOut for each request that got tokens, until the request's finished one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from scheduler.serve_config import (
    CheckpointSpec,
    LoadPolicy,
    Payload,
    Placement,
    RankConfig,
    SchedulingConfig,
    Selection,
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
    refresh_tokens: int = 0  # tokens those refreshes replayed
    # every checkpoint the tree took, at a prefill boundary or when a request finished; minus
    # checkpoints_evicted it is always the number cached
    checkpoints_stored: int = 0
    kv_evicted_rows: int = 0
    checkpoints_evicted: int = 0

    def loads(self, policy: LoadPolicy) -> int:
        return self.loads_wr if policy is LoadPolicy.WR else self.loads_nr


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
                "chunked_prefill_size": self.chunked_prefill_size, "w_max": ckpt.w_max,
                "load_policy": str(ckpt.load_policy), "checkpoint_format": ckpt.format,
                "arm": ckpt.arm}


# ---- scheduler <-> rank 0 ----------------------------------------------------------------------


@dataclass(slots=True)
class RankInfo:
    """Rank 0's start-up report: the byte accounting the scheduler sizes its pools with."""

    model_type: str
    tp_size: int
    vocab_size: int
    eos_token_id: int | None
    max_context_len: int
    num_checkpoint_slots: int
    checkpoint_bytes_per_slot: int  # max over ranks
    dense_bytes_per_slot: int  # max over ranks, W_max = 0
    refresh_window: int  # dasc-wr replay length W_wr (0: nothing omitted)
    prefill_tokens_per_s: float = 0.0  # measured at start-up with step_target_ms, else 0


@dataclass(slots=True)
class LogitControls:
    """A request's logit controls, sent to rank 0 once, with its first sample (index 0).  Rank
    0 keeps them, with counts of the tokens it samples for the request, until the plan that
    releases the request's row table, so later steps carry nothing and the history never
    travels.  Applied in this order to the model's logits: repetition penalty (tokens of
    ``prompt_ids`` or the output), presence and frequency penalties (output), ``logit_bias``,
    then ``banned_ids`` -> -inf while fewer than ``min_tokens`` tokens have been sampled, then
    the ``grammar``'s mask (every token it disallows -> -inf; if the controls before it left
    no allowed token finite, the mask alone on the model's logits: the grammar wins)."""

    logit_bias: dict[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    banned_ids: list[int]  # stop_token_ids, and EOS unless ignore_eos
    prompt_ids: list[int]  # distinct prompt tokens; empty unless repetition_penalty != 1
    grammar: str = ""  # SamplingParams.grammar


@dataclass(slots=True)
class Sample:
    """Sampling of the token that follows a sequence's last new token (rank 0 does it)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int  # with ``index``: one generator per (request, output position)
    index: int
    controls: LogitControls | None = None  # index 0 of a request that has any
    num_top_logprobs: int = 0  # report this many likeliest tokens with the sampled one


@dataclass(slots=True)
class SeqStep:
    """One sequence of a forward step: ``token_ids`` at positions [prefix_len, prefix_len + n)
    of request ``rid``, whose KV rows (page size 1: one row per position) are the head of the
    row table the ranks hold for it (``BatchPlan.tables``)."""

    rid: str
    token_ids: list[int]
    prefix_len: int
    state_slot: int
    sample: Sample | None = None
    # prompt logprobs: the tokens that follow token_ids[: len(targets)] (the prompt tokens at
    # positions [prefix_len + 1, ...)), and how many likeliest tokens to report with each
    logprob_targets: list[int] = field(default_factory=list)
    num_top_targets: int = 0


@dataclass(slots=True)
class BatchPlan:
    """One step. Ranks execute it in this order, which is what makes slot reuse within a step
    safe: (1) ``stores_before`` active -> checkpoint (states of requests finished last step),
    (2) ``loads`` checkpoint -> active (hits), (3) ``refresh`` (dasc-wr replay into scratch
    slots, read-only KV), (4) forward ``seqs``, (5) ``stores_after`` active -> checkpoint.

    Row tables: a request's KV rows travel once, when it is admitted or when the tree replaces
    some of them (``tables``: every row it may ever use), and are dropped when it ends
    (``release``, applied first); a step's sequences then name only their request, so a plan
    is O(new tokens), not O(context)."""

    step_id: int
    release: list[str] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    stores_before: list[tuple[int, int]] = field(default_factory=list)  # (active, ckpt)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (ckpt, active)
    refresh: list[SeqStep] = field(default_factory=list)  # state_slot = the request's slot
    refresh_scratch: list[int] = field(default_factory=list)
    seqs: list[SeqStep] = field(default_factory=list)
    stores_after: list[tuple[int, int]] = field(default_factory=list)  # (active, ckpt)


class RowTables:
    """The ranks' copies of the row tables a stream of plans carries; ``convert`` turns a table
    into what the caller keeps (a list here, a tensor on the ranks)."""

    def __init__(self, convert=list):
        self._tables: dict[str, object] = {}
        self._convert = convert

    def __len__(self) -> int:
        return len(self._tables)

    def apply(self, plan: BatchPlan) -> None:
        for rid in plan.release:
            self._tables.pop(rid, None)
        for rid, rows in plan.tables.items():
            self._tables[rid] = self._convert(rows)

    def rows(self, rid: str):
        """Request rid's whole table (covering at least every step it is named in)."""
        table = self._tables.get(rid)
        if table is None:
            raise RuntimeError(f"plan names row table {rid!r}, which the ranks do not hold")
        return table


@dataclass(slots=True)
class StepResult:
    step_id: int
    token_ids: list[int]  # one per sequence with a ``sample``, in plan order
    compute_s: float  # rank 0's wall time for the step (store/load/refresh/forward/sample)
    logprobs: list[float] = field(default_factory=list)  # of each sampled token, temperature 1
    # per sampled token, its row's ``num_top_logprobs`` likeliest tokens ([] for a row that
    # asks for none); both empty when no row of the step asks
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # per sequence with ``logprob_targets``, in plan order: each target's logprob, and its
    # row's ``num_top_targets`` likeliest ids and logprobs ([] per target when 0)
    target_logprobs: list[list[float]] = field(default_factory=list)
    target_top_ids: list[list[list[int]]] = field(default_factory=list)
    target_top_logprobs: list[list[list[float]]] = field(default_factory=list)


MESSAGE_TYPES = (
    SamplingParams, GenerateReq, AbortReq, FlushCacheReq, StatsReq, Shutdown, TokenOut,
    TokenBatch, FlushCacheDone, Counters, Stats,
    ServerInfo, RankInfo, LogitControls, Sample, SeqStep, BatchPlan, StepResult,
    # the serving config, inside ServerInfo
    ServeConfig, RankConfig, SchedulingConfig, CheckpointSpec, LoadPolicy, Selection, Payload,
    Placement,
)
