"""Which checkpoint a full pool drops (``--checkpoint-eviction``): ``lru`` (least recently
consumed) or ``reuse`` (``by_value``: recency plus the prefill a hit there saves)."""

from __future__ import annotations

from scheduler.radix_node import Node


def by_value(nodes: list[Node]) -> list[Node]:
    """Least valuable first, after Marconi (recency plus compute saved per stored byte):
    value = recency rank in [0, 1] + saved tokens / the most any candidate saves.  A hit here
    saves the tokens between the nearest ancestor holding a checkpoint and this node (without
    it a request falls back to that ancestor); every slot stores the same bytes, so per byte is
    per slot.  A prompt-end checkpoint just past a shared one saves little and goes first."""
    saved = {}
    for n in nodes:
        up = n.parent
        while up is not None and up.ckpt is None:
            up = up.parent
        saved[id(n)] = n.depth - (up.depth if up is not None else 0)
    most = max(saved.values())
    rank = recency_ranks(nodes, lambda n: n.ckpt_access)
    return sorted(nodes, key=lambda n: (rank[id(n)] + saved[id(n)] / most, n.ckpt_access))


def recency_ranks(items: list, access) -> dict[int, float]:
    """id(item) -> its rank by ``access(item)`` in [0, 1], 0 the least recent."""
    by_age = sorted(items, key=access)
    return {id(x): i / max(1, len(items) - 1) for i, x in enumerate(by_age)}
