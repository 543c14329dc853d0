"""What an evaluation arm does to the cache a prefix hit would restore.

Arms: ``dense`` (nothing), ``nr@W`` (store the prefix state as a dasc checkpoint at W_max = W
and load it back: omitted units zero-filled), ``wr@W`` (nr, then the omitted units are refreshed
by replaying the last W_wr context tokens), ``nr-int8@W`` (INT8 payload), ``random@W``
(count-matched random selection with a mask seed), and the Table 1(a) interventions
``zero-full-kv``, ``zero-linear``, ``zero-both`` (zero the context's full-attention KV rows, the
linear-attention state, or both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner

INTERVENTIONS = ("zero-full-kv", "zero-linear", "zero-both")
COMPRESSED = ("nr", "wr", "nr-int8", "random")
RANDOM_SEED = 1234  # the first of the paper's mask seeds


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm of a sweep; random arms carry their mask seed (one count-matched plan each)."""

    name: str  # "dense", an intervention, or "<kind>@<W_max>"
    mask_seed: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.mask_seed is None else f"{self.name}/s{self.mask_seed}"


def parse_arm(arm: str) -> tuple[str, float]:
    """"dense" | intervention | "<kind>@<W_max>" -> (kind, W_max)."""
    if arm == "dense" or arm in INTERVENTIONS:
        return arm, 0.0
    kind, _, w = arm.partition("@")
    try:
        w_max = float(w)
    except ValueError:
        w_max = -1.0
    if kind not in COMPRESSED or not 0 < w_max < float("inf"):
        raise ValueError(f"unknown arm {arm!r}: use dense, {', '.join(INTERVENTIONS)} or "
                         f"{'|'.join(COMPRESSED)}@W_MAX (e.g. nr@16), or a bare kind with "
                         "--w-max")
    return kind, w_max


def expand_arms(arms: list[str], w_max_list: list[float], mask_seeds: list[int]) -> list[Arm]:
    """Arm names -> the arms to run.  A bare compressed kind ("nr") runs at every W in
    ``w_max_list``; a random arm runs once per mask seed.  Duplicates are dropped."""
    names = []
    for arm in arms:
        if arm in COMPRESSED:
            if not w_max_list:
                raise ValueError(f"arm {arm!r} without @W_MAX needs --w-max")
            names += [f"{arm}@{w:g}" for w in w_max_list]
        else:
            names.append(arm)
    out = []
    for name in names:
        kind, w_max = parse_arm(name)
        name = name if kind not in COMPRESSED else f"{kind}@{w_max:g}"  # "nr@16.0" -> "nr@16"
        for seed in (mask_seeds if kind == "random" else [None]):
            if Arm(name, seed) not in out:
                out.append(Arm(name, seed))
    return out


def prepare_arm(runner: ModelRunner, arm: str, batch: int, mask_seed: int = RANDOM_SEED):
    """Attach the checkpoint pool a compressed arm stores through (``batch`` slots) and return
    it; ``None`` for the other arms."""
    from model_runner.checkpoints.pool import CheckpointFormat
    from model_runner.compression.horizons import static_horizons
    from model_runner.compression.plan import dasc_plan, random_plan
    from model_runner.compression.weights import load_decay_params

    kind, w_max = parse_arm(arm)
    if kind not in COMPRESSED:
        return None
    horizons = static_horizons(runner.cfg, load_decay_params(runner.rc.model_dir, runner.cfg))
    plan = dasc_plan(runner.identity(), horizons, w_max)
    if kind == "random":
        plan = random_plan(plan, horizons, mask_seed)
    payload = "int8" if kind == "nr-int8" else "fp32"
    return runner.attach_checkpoints(plan, batch, CheckpointFormat(payload=payload))


def apply_arm(runner: ModelRunner, seqs: list[SeqInput], arm: str,
              contexts: list[list[int]] | None = None) -> None:
    """What a cache hit on each sequence's prefix [0, prefix_len) would restore.  ``wr`` needs
    the context ids and as many spare state slots after the batch's as there are sequences."""
    kind, _ = parse_arm(arm)
    if kind in COMPRESSED:
        slots = [s.state_slot for s in seqs]
        ckpt = list(range(len(seqs)))
        runner.store_checkpoints(slots, ckpt)
        runner.zero_state_slots(slots)
        runner.load_checkpoints(ckpt, slots)
        window = runner.checkpoints.plan.refresh_window
        if kind == "wr" and window > 0:
            replay = []
            for s, ctx in zip(seqs, contexts):
                start = max(0, len(ctx) - window)
                replay.append(SeqInput(ctx[start:], start, s.page_table, s.state_slot))
            scratch = [max(slots) + 1 + i for i in range(len(seqs))]
            runner.refresh_omitted(replay, scratch)
    else:
        apply_intervention(runner, seqs, kind)


def prefix_kv_rows(runner: ModelRunner, seq: SeqInput) -> torch.Tensor:
    """Flat KV-pool rows of the sequence's cached prefix [0, prefix_len)."""
    page = runner.rc.page_size
    pos = torch.arange(seq.prefix_len)
    pages = torch.tensor(seq.page_table)[pos // page]
    return (pages * page + pos % page).to(runner.device)


def touches_kv(arm: str) -> bool:
    return arm in ("zero-full-kv", "zero-both")


def apply_intervention(runner: ModelRunner, seqs: list[SeqInput], kind: str) -> None:
    """Zero what the cache holds for each sequence's prefix [0, prefix_len)."""
    if touches_kv(kind):
        for s in seqs:
            rows = prefix_kv_rows(runner, s)
            for cache in runner.kv.caches:
                cache[rows] = 0
    if kind in ("zero-linear", "zero-both"):
        for s in seqs:
            runner.zero_state(s.state_slot)
