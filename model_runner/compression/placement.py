"""Head bundles across TP ranks: which global units a rank holds, and the balancing permutation.

A bundle is the smallest group of state that moves between ranks as a whole:
    GDN: key head j with its value heads [j*g, (j+1)*g), g = gva_ratio -> units [j*g, (j+1)*g)
    KDA: head h                                                  -> units [h*K, (h+1)*K)
so bundle b always owns the contiguous unit range [b*w, (b+1)*w), w = units per bundle.
`head_order[l]` is a permutation of [0, nb); rank r owns bundles head_order[l][r*m:(r+1)*m],
m = nb / T, in that order, and its local units follow the owned bundles in order.
"""

from __future__ import annotations

from model_runner.compression.plan import PlanError, SelectionPlan
from model_runner.config import ModelConfig

PLACEMENTS = ("off", "storage", "hybrid")

HeadOrder = list[list[int]]


def num_bundles(cfg: ModelConfig) -> int:
    return cfg.linear_num_key_heads


def units_per_bundle(cfg: ModelConfig) -> int:
    return cfg.gva_ratio * cfg.units_per_head


def check_bundle_split(cfg: ModelConfig, tp_size: int) -> None:
    """Raise PlanError unless `tp_size` splits the linear head bundles evenly."""
    nb = num_bundles(cfg)
    if not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"TP degree must be a positive integer, got {tp_size!r}")
    if nb % tp_size:
        what = "key heads" if cfg.linear_kind == "gdn" else "heads"
        raise PlanError(f"TP degree {tp_size} does not divide the {nb} linear-attention {what}")


def check_head_order(cfg: ModelConfig, head_order: HeadOrder | None) -> HeadOrder:
    """Validate (or default to identity) a per-layer bundle permutation."""
    nb, num_layers = num_bundles(cfg), cfg.num_linear_layers
    if head_order is None:
        return [list(range(nb)) for _ in range(num_layers)]
    if len(head_order) != num_layers:
        raise PlanError(f"head_order has {len(head_order)} layers, the model {num_layers}")
    for l, order in enumerate(head_order):
        if sorted(order) != list(range(nb)):
            raise PlanError(f"head_order[{l}] is not a permutation of range({nb})")
    return [list(order) for order in head_order]


def owned_bundles(head_order: HeadOrder, tp_rank: int, tp_size: int) -> list[list[int]]:
    """Per layer, the bundle ids rank `tp_rank` holds, in local order."""
    out = []
    for order in head_order:
        m = len(order) // tp_size
        out.append(order[tp_rank * m : (tp_rank + 1) * m])
    return out


def local_units(
    cfg: ModelConfig, head_order: HeadOrder | None, tp_rank: int, tp_size: int
) -> list[list[int]]:
    """Per linear layer, the global unit ids held on `tp_rank`, in local unit order.

    Local unit index: GDN u = local value head; KDA u = local_head * K + k. The local value heads
    of layer l are [b*g + i for b in owned bundles for i in range(g)] (GDN g = gva_ratio, KDA 1).
    """
    check_bundle_split(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise PlanError(f"TP rank {tp_rank} is outside [0, {tp_size})")
    order = check_head_order(cfg, head_order)
    w = units_per_bundle(cfg)
    return [[b * w + i for b in owned for i in range(w)]
            for owned in owned_bundles(order, tp_rank, tp_size)]


def local_value_heads(
    cfg: ModelConfig, head_order: HeadOrder | None, tp_rank: int, tp_size: int
) -> list[list[int]]:
    """Per linear layer, the global value heads held on `tp_rank` in local order."""
    per_head = cfg.units_per_head
    units = local_units(cfg, head_order, tp_rank, tp_size)
    return [[u // per_head for u in layer[::per_head]] for layer in units]


def bundle_weights(plan: SelectionPlan, cfg: ModelConfig) -> list[list[int]]:
    """Retained units per bundle, [L][nb]: bundle b owns units [b*w, (b+1)*w)."""
    plan.check_config(cfg)
    w = units_per_bundle(cfg)
    weights = [[0] * num_bundles(cfg) for _ in plan.retained]
    for row, units in zip(weights, plan.retained, strict=True):
        for u in units:
            row[u // w] += 1
    return weights


def rank_layer_counts(
    plan: SelectionPlan, cfg: ModelConfig, head_order: HeadOrder | None, tp_size: int
) -> list[list[int]]:
    """r_{l,r}: retained units of layer l held on rank r, [L][T]."""
    check_bundle_split(cfg, tp_size)
    order = check_head_order(cfg, head_order)
    weights = bundle_weights(plan, cfg)
    counts = [[0] * tp_size for _ in order]
    for l, row in enumerate(order):
        m = len(row) // tp_size
        for pos, b in enumerate(row):
            counts[l][pos // m] += weights[l][b]
    return counts


def rank_row_counts(
    plan: SelectionPlan,
    cfg: ModelConfig,
    head_order: HeadOrder | None,
    tp_size: int,
    layout: str = "ragged",
) -> list[int]:
    """Packed checkpoint rows per rank before storage balancing.

    ragged: U_r = sum_l r_{l,r}; padded: L * max_l r_{l,r} (each rank pads to its own widest
    layer, which gives the same worst rank as one R_max for the whole group).
    """
    per_layer = rank_layer_counts(plan, cfg, head_order, tp_size)
    if layout == "ragged":
        return [sum(col) for col in zip(*per_layer, strict=True)]
    if layout == "padded":
        return [len(per_layer) * max(col) for col in zip(*per_layer, strict=True)]
    raise PlanError(f"layout must be ragged or padded, got {layout!r}")


def head_permutation(plan: SelectionPlan, cfg: ModelConfig, tp_size: int) -> HeadOrder:
    """Per-layer bundle permutation that evens the per-rank retained totals (summed over layers).

    Every rank keeps nb/T bundles in every layer (compute stays balanced). Layers are dealt in
    rounds of T bundles, heaviest bundle to the currently lightest rank; by induction over rounds
    the spread max_r U_r - min_r U_r never exceeds the heaviest bundle w, so
        max_r U_r <= sum_r U_r / T + w <= C + w,   C = ceil(sum_r U_r / T).
    Pairwise in-layer swaps that strictly lower the worst rank follow; they never raise the
    maximum, so the bound holds for the result. Deterministic (ties go to lower ids).
    """
    check_bundle_split(cfg, tp_size)
    weights = bundle_weights(plan, cfg)  # [L][nb]
    nb, num_layers = num_bundles(cfg), plan.num_layers
    loads = [0] * tp_size
    owned: list[list[list[int]]] = [[[] for _ in range(tp_size)] for _ in range(num_layers)]
    # Heavy, uneven layers first: later, lighter layers fill the gaps they leave.
    layer_order = sorted(range(num_layers), key=lambda l: (-max(weights[l]), -sum(weights[l]), l))
    for l in layer_order:
        bundles = sorted(range(nb), key=lambda b: (-weights[l][b], b))
        for start in range(0, nb, tp_size):
            ranks = sorted(range(tp_size), key=lambda r: (loads[r], r))
            for r, b in zip(ranks, bundles[start : start + tp_size], strict=True):
                owned[l][r].append(b)
                loads[r] += weights[l][b]
    _improve_by_swaps(weights, owned, loads, max_rounds=4 * num_layers * nb)
    return [[b for r in range(tp_size) for b in sorted(owned[l][r])] for l in range(num_layers)]


def _improve_by_swaps(
    weights: list[list[int]], owned: list[list[list[int]]], loads: list[int], max_rounds: int
) -> None:
    """Swap one bundle of the worst rank with a lighter bundle of another rank in the same layer
    while that strictly lowers the pair's maximum below the worst load."""
    tp_size = len(loads)
    for _ in range(max_rounds):
        worst = max(range(tp_size), key=lambda r: (loads[r], -r))
        best = None  # (new pair max, layer, i, other rank, j)
        for l, per_rank in enumerate(owned):
            for i, a in enumerate(per_rank[worst]):
                for s in range(tp_size):
                    if s == worst:
                        continue
                    for j, b in enumerate(per_rank[s]):
                        delta = weights[l][a] - weights[l][b]
                        if delta <= 0:
                            continue
                        pair_max = max(loads[worst] - delta, loads[s] + delta)
                        if pair_max < loads[worst] and (best is None or pair_max < best[0]):
                            best = (pair_max, l, i, s, j)
        if best is None:
            return
        _, l, i, s, j = best
        a, b = owned[l][worst][i], owned[l][s][j]
        owned[l][worst][i], owned[l][s][j] = b, a
        delta = weights[l][a] - weights[l][b]
        loads[worst] -= delta
        loads[s] += delta


def placement_head_order(
    plan: SelectionPlan, cfg: ModelConfig, tp_size: int, placement: str
) -> HeadOrder | None:
    """The head order the model must be loaded with for `placement` (None = identity)."""
    if placement not in PLACEMENTS:
        raise PlanError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    return head_permutation(plan, cfg, tp_size) if placement == "hybrid" else None
