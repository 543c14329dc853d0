"""Store-time balancing schedule: the TP group as one pool of checkpoint rows of width C per rank.

Rank r packs U_r rows (its compute-local checkpoint rows, in local row order). With
C = ceil(sum_r U_r / T), every rank's checkpoint slot has C rows:
    slot rows [0, min(U_r, C))        own packed rows [0, min(U_r, C))
    slot rows [U_r, U_r + in_r)       rows received from donors, in source-rank order (U_r < C)
    the rest                          unused slack (zero)
Own packed rows [C, U_r) (donors, U_r > C) live on other ranks: the excess of all donors in rank
order is matched to the free space of all receivers in rank order, so every (src, dst) pair moves
one contiguous row range and one variable-split `all_to_all_single` carries a whole store (load
runs the same exchange backwards; ``model_runner/checkpoints/redistribute.py``). Every rank
derives the same schedule from the counts alone, without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StorageBalance:
    counts: tuple[int, ...]  # U_r: packed rows per rank
    width: int  # C: checkpoint rows per rank
    send: tuple[tuple[int, ...], ...]  # send[r][d]: rows rank r hands to rank d

    @property
    def tp_size(self) -> int:
        return len(self.counts)

    @property
    def moved_rows(self) -> int:
        """Rows crossing ranks per stored checkpoint."""
        return sum(map(sum, self.send))

    def kept(self, rank: int) -> int:
        return min(self.counts[rank], self.width)

    def received(self, rank: int) -> list[int]:
        """Rows rank `rank` receives from each source rank."""
        return [self.send[s][rank] for s in range(self.tp_size)]


def balance_storage(counts: list[int]) -> StorageBalance:
    """Two-pointer match of donor excess rows to receiver free rows (both in rank order)."""
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"need non-negative per-rank row counts, got {counts}")
    tp_size = len(counts)
    width = math.ceil(sum(counts) / tp_size)
    send = [[0] * tp_size for _ in range(tp_size)]
    excess = [max(c - width, 0) for c in counts]
    free = [max(width - c, 0) for c in counts]
    dst = 0
    for src in range(tp_size):
        while excess[src]:
            while free[dst] == 0:
                dst += 1
            n = min(excess[src], free[dst])
            send[src][dst] += n
            excess[src] -= n
            free[dst] -= n
    return StorageBalance(tuple(counts), width, tuple(tuple(row) for row in send))
