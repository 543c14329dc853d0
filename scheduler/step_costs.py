"""Decode first (``--decode-first cost``): a step defers its prefill while finishing the running
decodes first costs the waiting prompts less than the prefill would cost the decodes.

A step that carries P prefill tokens delays each of the D decoding requests by that prefill's
time, T_prefill(P).  Deferring it instead delays each of the W requests waiting to prefill
until the decodes end: at most R decode steps, R the most tokens a decoding request may still
sample (``max_tokens`` minus its output).  By shortest-job-first's exchange argument the order
with the smaller total delay goes first, so the step defers when

    D * T_prefill(P) > W * R * T_decode   and   R * T_decode < T_prefill(P).

The second condition bounds what deferring costs any one prompt: it waits less than its own
prefill takes.  While a step defers, no request starts decoding and R falls by one a step, so
the prefill runs at most R decode steps later.

Where a prefill token costs much more than a decode step's share (a CPU: the step's GEMMs are
compute-bound from a few rows on), a long prompt waits for short answers to finish; where
decode steps cost about as much as a long prefill (a GPU, latency-bound), nothing is deferred.

The times are the ranks' own (``StepResult.compute_s``), averaged as steps run: T_decode over
decode-only steps, a prefill token's cost over steps of at least ``MIN_SAMPLE_TOKENS`` prefill
tokens, beyond T_decode.  Until both have been seen, no step defers.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLE_TOKENS = 32  # a step with fewer prefill tokens than this says little about a token
SMOOTHING = 0.25  # weight of the newest step in each running average


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass(slots=True)
class StepCosts:
    decode_s: float | None = None  # one decode-only step
    token_s: float | None = None  # one prefill token, beyond a decode-only step

    def observe(self, num_seqs: int, prefill_tokens: int, compute_s: float) -> None:
        """One step's rank time, given its sequences and the prefill tokens among them (a
        step of checkpoint stores alone says nothing)."""
        if num_seqs == 0:
            return
        if prefill_tokens == 0:
            self.decode_s = _average(self.decode_s, compute_s)
        elif prefill_tokens >= MIN_SAMPLE_TOKENS and self.decode_s is not None:
            extra = max(0.0, compute_s - self.decode_s)
            self.token_s = _average(self.token_s, extra / prefill_tokens)

    def defers(self, num_decoding: int, decode_steps_left: int, num_prefilling: int,
               prefill_tokens: int) -> bool:
        """Whether a step should run only the decodes (the module docstring's rule)."""
        if self.decode_s is None or self.token_s is None or num_decoding == 0 \
                or num_prefilling == 0:
            return False
        wait, prefill = decode_steps_left * self.decode_s, prefill_tokens * self.token_s
        return wait < prefill and num_decoding * prefill > num_prefilling * wait
