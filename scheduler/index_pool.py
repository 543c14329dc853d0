"""Free lists of integer ids: KV rows (page size 1: one row per token) and checkpoint slots.

Why page size 1: a checkpoint boundary may fall at any token (the prompt end sits at
prompt_len - 1), and a hit must find the KV of exactly [0, boundary).  With one row per token
every boundary is a page boundary, nothing is copied on write, and the runner's page table is the
row list itself.
"""

from __future__ import annotations


class IndexPool:
    """Ids in [first, first + size).  ``alloc`` takes the lowest ids of a fresh pool first and
    then the most recently freed ones (a stack: deterministic, and a freed id is reused while
    its memory is warm)."""

    def __init__(self, size: int, first: int = 0):
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self.first, self.size = first, size
        self._free = list(range(first + size - 1, first - 1, -1))  # pop() gives the lowest
        self._is_free = [True] * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i - self.first] = False
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not self.first <= i < self.first + self.size or self._is_free[i - self.first]:
                raise ValueError(f"double free or foreign id {i}")
            self._is_free[i - self.first] = True
        self._free.extend(reversed(ids))

    def free_ids(self) -> set[int]:
        return set(self._free)
