"""Typed messages between the scheduler and rank 0 (which forwards to the other ranks): rank 0's
start-up report, one ``BatchPlan`` per step with its sequences and samples, and the
``StepResult`` that answers it.  Plain dataclasses, no torch; ``scheduler.wire.messages`` lists them
among the classes IPC may decode."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # rank 0's memory for the weights, in every form it holds them (as loaded, packed, coded,
    # the LM head's int8 screen), less the weights those copies stand in for
    weight_bytes: int = 0
    # the second cache tier (--cache-tier-dir): what an entry's files must have been written
    # by (model, weights, TP degree, plan, checkpoint format), and rank 0's bytes per entry
    tier_fingerprint: str = ""
    kv_bytes_per_token: int = 0
    tier_slot_bytes: int = 0


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
    # report the sampled token's logprob; a greedy row without it, controls or top logprobs
    # may take the screened LM head (kernels/lm_head), which computes no logprobs (NaN sent)
    logprob: bool = True


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
    # (cut, slot): the state after ``token_ids[:cut]`` is also left in this (scratch) slot,
    # for a checkpoint store after the forward (``model_runner.batch``); cuts rise
    snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class TierMove:
    """An entry of the second cache tier on its way out (spill) or in (fetch): the KV rows of
    its prefix, one per token, and one checkpoint slot (``scheduler/cache_tier.py``)."""

    entry: int
    slot: int
    rows: list[int]


@dataclass(slots=True)
class BatchPlan:
    """One step. Ranks execute it in this order, which is what makes slot reuse within a step
    safe: (1) ``stores_before`` active -> checkpoint (states of requests finished last step),
    (2) ``loads`` checkpoint -> active (hits), (3) ``refresh`` (dasc-wr replay into scratch
    slots, read-only KV), (4) forward ``seqs``, (5) ``stores_after`` active -> checkpoint (an
    active slot here may be one of a sequence's ``snapshots``).  The second cache tier's
    ``spills`` are copied out before all of them (this very step may reuse their rows and
    slots), its ``fetches`` read in after all of them (a ``stores_before`` may write a slot an
    eviction freed for a fetch).  ``tier_sync``: answer once every spill so far is written.

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
    spills: list[TierMove] = field(default_factory=list)
    fetches: list[TierMove] = field(default_factory=list)
    tier_free: list[int] = field(default_factory=list)  # host-memory entries to drop, first
    tier_sync: bool = False


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
    # the second cache tier: spilled entries now on disk on every rank, or failed on one; the
    # step's fetches that failed their checks on a rank (the others are in place)
    tier_written: list[int] = field(default_factory=list)
    tier_write_failed: list[int] = field(default_factory=list)
    tier_fetch_failed: list[int] = field(default_factory=list)
    tier_fetch_s: float = 0.0  # rank 0's time reading the step's fetches
    screened: int = 0  # sampled tokens the screened LM head gave (their logprobs are NaN)
