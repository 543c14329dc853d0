"""What the scheduler plans within beyond its own config: the checkpoint pool, the context, the
vocabulary and the refresh window that rank 0 reports at start-up, and how a checkpoint hit
restores its omitted units (the served ``CheckpointSpec``'s load policy).  The scheduler's
policy and pool sizes are its ``SchedulingConfig`` (``scheduler.wire.serve_config``)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.wire.serve_config import LoadPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLimits:
    num_checkpoint_slots: int
    max_context_len: int
    vocab_size: int
    eos_token_id: int | None = None
    load_policy: LoadPolicy = LoadPolicy.NR  # the checkpoints' (CheckpointSpec.load_policy)
    refresh_window: int = 0  # dasc-wr: cached tokens a hit replays
