"""Helpers for the radix cache tests (tests/scheduler/test_radix_cache*.py) and the scheduler's
symbolic ranks: building a cache, inserting as a caller must, walking the tree, prefix
identities."""

from __future__ import annotations

from scheduler.index_pool import IndexPool
from scheduler.radix_cache import Node, RadixCache


def make_cache(num_rows: int = 256, num_ckpts: int = 16) -> RadixCache:
    return RadixCache(IndexPool(num_rows), IndexPool(num_ckpts))


def put(cache: RadixCache, tokens: list[int], with_ckpt: bool = True) -> tuple[Node, list[int]]:
    """Insert ``tokens`` with freshly allocated rows (and a checkpoint); free the duplicates
    the tree did not adopt, as a caller must.  Returns the node and the tree's rows."""
    rows = cache.kv_pool.alloc(len(tokens))
    ckpt = cache.alloc_ckpt() if with_ckpt else None
    res = cache.insert(tokens, rows, ckpt)
    cache.kv_pool.free(rows[: res.num_existing])
    if ckpt is not None and not res.ckpt_taken:
        cache.ckpt_pool.free([ckpt])
    return res.node, res.kv_rows


def node_at(cache: RadixCache, tokens: list[int]) -> Node | None:
    """The node whose path is exactly ``tokens`` (walked here, not through the cache)."""
    node, pos = cache.root, 0
    while pos < len(tokens):
        node = node.children.get(tokens[pos])
        if node is None or node.key != tokens[pos : pos + len(node.key)]:
            return None
        pos += len(node.key)
    return node if pos == len(tokens) else None


def tree_paths(cache: RadixCache) -> dict[tuple[int, ...], Node]:
    out, stack = {}, [((), cache.root)]
    while stack:
        path, node = stack.pop()
        out[path] = node
        for child in node.children.values():
            stack.append((path + tuple(child.key), child))
    return out


def is_attached(cache: RadixCache, node: Node) -> bool:
    while node.parent is not None:
        if node.parent.children.get(node.key[0]) is not node:
            return False
        node = node.parent
    return node is cache.root


def check(cache: RadixCache, locked: list[Node] = (), ckpt_locked: list[Node] = ()) -> None:
    cache.check_integrity([], [], list(locked), list(ckpt_locked))


def prefix_hashes(tokens: list[int]) -> list[int]:
    """hs[i] identifies tokens[: i + 1] (what KV row i and a state after i + 1 tokens encode)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out
