"""Which prefill work a step takes, and in what order (``--schedule-policy``).

``fcfs``  running prefills in admission order, then the waiting queue in arrival order; a step
          stops admitting at the first request that does not fit.
``lpm``   shortest remaining prefill first: a waiting request's remaining prefill is its prompt
          minus the prefix the cache would restore, so among equal prompts the longest prefix
          match goes first (SGLang's lpm), and hits are not queued behind misses.  A step that
          already holds prefill chunks defers a chunk more than ``prefill_mix_ratio`` times longer
          than its longest one, so a step of hits (one token each at a prompt-end checkpoint)
          is not stretched by a miss's whole prompt; the miss runs in the next step.

Decode interleave (either policy, ``decode_interleave`` N > 0): while requests decode, a step
carries prefill only after N decode-only steps in a row, so a decode waits behind at most one
prefill step in N + 1 (TGI's ``max_waiting_tokens``).  Where a step with any prefill chunk
costs several decode steps (a CPU: small-M GEMMs, the chunked delta rule's fixed cost), this
trades a prompt's TTFT (at most N decode steps more) for its neighbours' TPOT.

Fairness bound (lpm): a request is *passed* once each time a request that arrived after it gets
prefill in a step where it gets none.  Once passed ``schedule_max_passes`` times it is overdue:
overdue requests go first, in arrival order, and are never deferred, so no request waits behind
more than ``schedule_max_passes`` later arrivals (plus the steps those already hold).

Decode first (either policy, ``decode_first="cost"``): a step also leaves its prefill out while
the ranks' measured step times say the running decodes should finish first
(scheduler/step_costs.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from itertools import islice

from scheduler.request import Req
from scheduler.wire.serve_config import SchedulePolicyName, SchedulingConfig

# lpm ranks at most this many of the oldest waiting requests per step (each costs a prefix
# match); the rest keep arrival order behind them, as SGLang falls back to fcfs on long queues
LPM_MAX_RANKED = 128


class SchedulePolicy:
    """A step's prefill order, by the scheduling config's policy fields (the default, lpm,
    measured best: docs/results/serving.md, "Schedule policies")."""

    __slots__ = ("cfg",)

    def __init__(self, cfg: SchedulingConfig):
        self.cfg = cfg

    @property
    def lpm(self) -> bool:
        return self.cfg.schedule_policy is SchedulePolicyName.LPM

    def takes_prefill(self, decoding: bool, decode_only_run: int) -> bool:
        """Whether a step may carry prefill, given whether any request decodes and how many
        decode-only steps ran since the last step that carried prefill."""
        return not decoding or decode_only_run >= self.cfg.decode_interleave

    def is_overdue(self, r: Req) -> bool:
        return r.num_passed >= self.cfg.schedule_max_passes

    def order(self, running: list[Req], waiting: Iterable[Req],
              remaining: Callable[[Req], int]) -> list[Req]:
        """Prefill candidates in the order a step offers them budget: ``running`` are the
        admitted requests still prefilling, ``waiting`` the queue in arrival order."""
        if not self.lpm:
            return running + list(waiting)
        waiting = iter(waiting)
        ranked = running + list(islice(waiting, LPM_MAX_RANKED))

        def key(r: Req) -> tuple[int, int, int]:
            if self.is_overdue(r):
                return (0, 0, r.arrival)
            return (1, remaining(r), r.arrival)

        return sorted(ranked, key=key) + list(waiting)

    @property
    def can_defer(self) -> bool:
        return self.lpm and self.cfg.prefill_mix_ratio > 0

    def defers(self, r: Req, chunk_len: int, longest_chunk: int) -> bool:
        """lpm: keep a chunk out of a step whose prefill chunks are all much shorter."""
        if not self.can_defer or longest_chunk == 0:
            return False
        return chunk_len > self.cfg.prefill_mix_ratio * longest_chunk and not self.is_overdue(r)


def count_passes(skipped: list[Req], served: list[Req]) -> None:
    """Every request that got no prefill this step is passed by each later arrival that did."""
    arrivals = sorted(r.arrival for r in served)
    for r in skipped:
        r.num_passed += len(arrivals) - bisect_right(arrivals, r.arrival)
