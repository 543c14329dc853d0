"""The scheduler's frozen config and the sizes derived from it (active state slots, the prefill
budget a measured rate allows)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.admission import DEFAULT_CKPT_ADMISSION
from scheduler.checkpoint_eviction import DEFAULT_CKPT_EVICTION
from scheduler.policy import SchedulePolicy
from scheduler.wire.serve_config import LoadPolicy


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


DEFAULT_CHUNKED_PREFILL = 2048  # --chunked-prefill-size without --step-target-ms


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_total_tokens: int  # KV rows (page size 1)
    max_running_requests: int  # active state slots
    num_checkpoint_slots: int
    max_context_len: int
    vocab_size: int
    eos_token_id: int | None = None
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL  # new tokens per step, decodes included
    checkpoint_interval: int = 256  # 0: prompt end only
    prefix_cache: bool = True
    cache_finished: bool = True
    park_finished: bool = True  # a finished request's slot stays in the tree until needed
    load_policy: LoadPolicy = LoadPolicy.NR
    refresh_window: int = 0
    policy: SchedulePolicy = SchedulePolicy()  # which prefill a step takes first
    checkpoint_eviction: str = DEFAULT_CKPT_EVICTION  # "reuse" | "lru" (RadixCache)
    checkpoint_admission: str = DEFAULT_CKPT_ADMISSION  # "all" | "reuse" (scheduler.admission)

    @property
    def scratch_slot_base(self) -> int:
        """Active slots: 0 reserved, [1, 1 + R) requests, [1 + R, 1 + 2R) wr scratch."""
        return 1 + self.max_running_requests

    @property
    def num_state_slots(self) -> int:
        return active_state_slots(self.max_running_requests)
