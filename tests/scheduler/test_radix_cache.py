"""Hybrid radix cache (scheduler/radix_cache.py): match, insert and split, each invariant on a
small tree.  Reclaiming and eviction: tests/scheduler/test_radix_cache_reclaim.py; seeded
random operation sequences: tests/scheduler/test_radix_cache_random.py."""

from __future__ import annotations

import random

import pytest
from support.radix_helpers import check, is_attached, make_cache, node_at, put, tree_paths

# ---- match ---------------------------------------------------------------------------------------


def test_match_returns_deepest_checkpoint_within_max_len_and_exactly_its_rows():
    cache = make_cache()
    seq = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]  # 13 tokens: lengths are multiples of nothing
    ckpt_lens = (3, 7)
    for n in ckpt_lens:
        put(cache, seq[:n])
    tail, tree_rows = put(cache, seq, with_ckpt=False)  # KV to 13, no checkpoint there
    cache.lock(tail)  # else it is a useless leaf
    check(cache, [tail])
    for max_len in range(len(seq) + 3):
        hit = cache.match(seq, max_len)
        want = max((n for n in ckpt_lens if n <= max_len), default=0)
        assert hit.length == want
        assert hit.kv_rows == tree_rows[:want]  # never the KV past the deepest checkpoint
        if want:
            assert hit.node is node_at(cache, seq[:want]) and hit.node.ckpt is not None
        else:
            assert hit.node is cache.root
    # a query that diverges inside the second edge only reaches the first checkpoint
    diverged = seq[:5] + [77, 78, 79, 80]
    hit = cache.match(diverged, len(diverged))
    assert (hit.length, hit.kv_rows) == (3, tree_rows[:3])
    # a query shorter than the first checkpoint hits nothing
    assert cache.match(seq[:2], 2).length == 0
    check(cache, [tail])


def test_match_ignores_kv_without_checkpoint():
    cache = make_cache()
    node, _ = put(cache, list(range(1, 10)), with_ckpt=False)
    cache.lock(node)
    hit = cache.match(list(range(1, 10)), 9)
    assert (hit.node, hit.length, hit.kv_rows) == (cache.root, 0, [])
    cache.unlock(node)
    assert not cache.root.children and cache.kv_pool.num_free == cache.kv_pool.size


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13, 31, 100, 257])
def test_any_length_prompt_end_checkpoint_hits(n):
    """Page size 1: a checkpoint at any token count is found, with exactly that many rows."""
    cache = make_cache(num_rows=600)
    rng = random.Random(n)
    seq = [rng.randrange(1000) for _ in range(n + 1)]
    _, rows = put(cache, seq[:n])
    hit = cache.match(seq, len(seq))
    assert hit.length == n and hit.kv_rows == rows and len(rows) == n
    assert cache.match(seq, n - 1).length == 0
    assert cache.ckpt_at(seq[:n]) == hit.node.ckpt
    check(cache)


# ---- insert / split ------------------------------------------------------------------------------


def test_split_by_diverging_insert_gives_the_new_parent_no_checkpoint():
    cache = make_cache()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = a[:6] + [60, 61, 62]
    put(cache, a)
    put(cache, b)
    mid = node_at(cache, a[:6])
    assert mid is not None and mid.ckpt is None and len(mid.children) == 2
    assert cache.match(a[:6] + [99], 7).length == 0  # the split point is no hit
    assert cache.match(a, 10).length == 10 and cache.match(b, 9).length == 9
    check(cache)


def test_split_by_shorter_insert_without_checkpoint_has_none():
    cache = make_cache()
    a = [3, 1, 4, 1, 5, 9, 2]
    node_a, rows_a = put(cache, a)
    short, short_rows = put(cache, a[:4], with_ckpt=False)
    assert short is node_at(cache, a[:4]) and short.ckpt is None
    assert short_rows == rows_a[:4]  # the tree kept the first insert's rows
    assert node_a.ckpt is not None and node_a.parent is short
    assert cache.match(a, 6).length == 0
    check(cache)  # `short` has a child: not a useless leaf although unlocked


def test_split_keeps_lock_counts_on_the_new_parent():
    cache = make_cache()
    a = list(range(20, 32))
    node_a, _ = put(cache, a)
    cache.lock(node_a)
    put(cache, a[:5] + [7, 7])  # splits a's edge at 5 while a is locked
    mid = node_at(cache, a[:5])
    assert mid.lock_ref == 1
    check(cache, [node_a])
    cache.unlock(node_a)
    check(cache)


def test_insert_of_cached_tokens_reports_num_existing_and_keeps_tree_rows():
    cache = make_cache()
    a = [9, 8, 7, 6, 5, 4, 3, 2]
    _, rows_a = put(cache, a)
    longer = a + [11, 12, 13]
    rows = cache.kv_pool.alloc(len(longer))
    res = cache.insert(longer, rows, None)
    assert res.num_existing == len(a)
    assert res.kv_rows == rows_a + rows[len(a) :]
    tree_rows = {r for n in tree_paths(cache).values() for r in n.value}
    assert not tree_rows & set(rows[: len(a)])  # duplicates are not adopted
    cache.lock(res.node)
    cache.check_integrity(rows[: len(a)], [], [res.node], [])  # ... they are still the caller's
    cache.kv_pool.free(rows[: len(a)])
    # an exact duplicate with a checkpoint where one exists: nothing adopted, slot refused
    dup_rows = cache.kv_pool.alloc(len(a))
    slot = cache.alloc_ckpt()
    dup = cache.insert(a, dup_rows, slot)
    assert dup.num_existing == len(a) and not dup.ckpt_taken and dup.kv_rows == rows_a
    cache.check_integrity(dup_rows, [slot], [res.node], [])
    cache.kv_pool.free(dup_rows)
    cache.ckpt_pool.free([slot])
    cache.unlock(res.node)
    check(cache)


def test_insert_gives_a_checkpoint_to_a_tombstone():
    cache = make_cache(num_ckpts=2)
    a = [1, 2, 3, 4, 5]
    node_a, _ = put(cache, a[:3])
    put(cache, a)
    cache.evict_ckpts(1)  # a[:3] is older: it becomes a tombstone
    assert node_a.ckpt is None and is_attached(cache, node_a)
    node, _ = put(cache, a[:3])
    assert node is node_a and node.ckpt is not None
    check(cache)
