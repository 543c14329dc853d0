"""The radix tree's node and the results of a match and an insert (scheduler/radix_cache.py)."""

from __future__ import annotations

from typing import NamedTuple


class Node:
    __slots__ = ("key", "value", "ckpt", "parked", "parent", "children", "depth", "lock_ref",
                 "ckpt_lock", "kv_access", "ckpt_access")

    def __init__(self, key: list[int], value: list[int], parent: Node | None, depth: int):
        self.key, self.value, self.parent, self.depth = key, value, parent, depth
        self.ckpt: int | None = None
        self.parked: int | None = None  # active slot holding the exact state after this node
        self.children: dict[int, Node] = {}
        self.lock_ref = self.ckpt_lock = 0
        self.kv_access = self.ckpt_access = 0

    def __lt__(self, other: Node) -> bool:  # heap tie-breaks
        return id(self) < id(other)


class MatchResult(NamedTuple):
    node: Node  # deepest matched node with a checkpoint or a parked slot (else the root)
    length: int  # tokens covered: [0, length)
    kv_rows: list[int]  # their KV rows (owned by the tree)


class InsertResult(NamedTuple):
    node: Node  # the node that ends at len(tokens)
    num_existing: int  # leading tokens that were already cached (their rows stay the tree's)
    kv_rows: list[int]  # the tree's rows for [0, len(tokens)) after the insert
    ckpt_taken: bool  # False: the node already had a checkpoint; the caller frees its slot


def common_prefix(key: list[int], tokens: list[int], pos: int) -> int:
    n = min(len(key), len(tokens) - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i
