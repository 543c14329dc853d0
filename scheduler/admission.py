"""Where a prefilling request stores checkpoints (``--checkpoint-admission``).

``branch`` (the default) ``all``'s points and ``reuse``'s branch point: a shared prefix of any
           length, off the interval grid too (a system prompt), is stored by its second
           sharer and hit from the third on.
``all``    every multiple of ``checkpoint_interval`` inside the prompt, and prompt_len - 1.
``reuse``  only where reuse is likely, after Marconi's admission for hybrid models:
           - prompt_len - 1, the end of a turn (as in ``all``);
           - the branch point: where the prompt leaves the tree, so the prefix up to it has
             been reached by at least two requests (an earlier one's path is in the tree),
             and the next request that shares it hits there.  Stored when a checkpoint there
             saves at least ``MIN_BRANCH_GAIN`` tokens over the deepest one above it: a turn
             that follows a finished turn branches one token past that turn's prompt-end
             checkpoint, which already covers it.
           A request that is the first to reach a prefix stores nothing inside it; its
           prompt-end store puts its path into the tree for the next one to branch from.
           ``checkpoint_interval`` plays no part: every multiple a second request has reached
           lies at or above its branch point, whose checkpoint covers it (storing them too
           measured lower: docs/results/serving.md, "Checkpoint admission").

prompt_len - 1 rather than prompt_len: a hit must leave one token to compute, so an exact
repeat can only hit before its last token (SGLang #21158).  Either policy keeps the checkpoint
of a finished request (prompt + output[:-1], the other end of a turn; the scheduler stores it).
The points are read from the tree when a chunk is planned, so they follow the tree as it
changes; a prefill chunk runs through the points that still lack a checkpoint, snapshotting the
state at each (scheduler/step_planner.py says when it ends at one instead).
"""

from __future__ import annotations

from scheduler.radix_cache import RadixCache

# A checkpoint saving fewer tokens is not worth a slot and the step its chunk split costs
# (a judgement, not a measurement; eviction by value would drop such a slot first anyway).
MIN_BRANCH_GAIN = 32


def store_points(prompt: list[int], interval: int, admission: str,
                 cache: RadixCache) -> list[int]:
    """Ascending prompt positions p in [1, len(prompt) - 1] whose state (after prompt[:p]) a
    prefilling request stores, unless the tree already holds a checkpoint there."""
    n = len(prompt)
    last = [n - 1] if n > 1 else []
    every = list(range(interval, n - 1, interval)) if interval > 0 else []
    if admission == "all":
        return every + last
    branch = cache.cached_len(prompt)
    if not (0 < branch < n - 1 and branch - cache.match_len(prompt, branch) >= MIN_BRANCH_GAIN):
        return every + last if admission == "branch" else last
    if admission == "reuse":
        return [branch, *last]
    return sorted({*every, branch}) + last
