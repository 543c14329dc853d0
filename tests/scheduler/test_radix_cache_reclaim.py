"""Hybrid radix cache (scheduler/radix_cache.py): how it gives memory back (tombstones and
reclaiming, ``evict_kv``, ``evict_ckpts``, ``flush``) and the locks that stop it."""

from __future__ import annotations

import pytest
from support.radix_helpers import check, is_attached, make_cache, node_at, put, tree_paths

# ---- tombstones and reclaiming -------------------------------------------------------------------


def test_evicted_checkpoint_with_children_leaves_a_tombstone_with_its_kv():
    cache = make_cache()
    seq = list(range(40, 52))
    inner, inner_rows = put(cache, seq[:5])
    _, rows = put(cache, seq)
    cache.match(seq, len(seq))  # consume the deeper one: the inner checkpoint is the LRU
    assert cache.evict_ckpts(1) == 1
    assert inner.ckpt is None and is_attached(cache, inner) and inner.value == inner_rows[:5]
    hit = cache.match(seq, len(seq))
    assert hit.length == len(seq) and hit.kv_rows == rows
    assert cache.match(seq, 11).length == 0  # the tombstone is no hit
    check(cache)


def test_locked_leaf_keeps_its_kv_without_checkpoint_until_unlocked():
    cache = make_cache()
    seq = [2, 7, 1, 8, 2, 8]
    node, rows = put(cache, seq)
    cache.lock(node)
    assert cache.evict_ckpts(1) == 1
    assert node.ckpt is None and is_attached(cache, node) and node.value == rows
    assert cache.evict_kv(100) == 0  # locked: not a candidate
    check(cache, [node])
    cache.unlock(node)  # now useless: reclaimed at once
    assert not cache.root.children and cache.kv_pool.num_free == cache.kv_pool.size
    check(cache)


def test_reclaiming_cascades_through_tombstones():
    cache = make_cache()
    seq = list(range(100, 117))
    top, _ = put(cache, seq[:4])
    mid, _ = put(cache, seq[:9])
    leaf, _ = put(cache, seq, with_ckpt=False)
    cache.lock(leaf)
    cache.match(seq, 9)  # touch mid: top is evicted first, then mid
    assert cache.evict_ckpts(2) == 2
    assert top.ckpt is None and mid.ckpt is None
    assert all(is_attached(cache, n) for n in (top, mid, leaf))
    check(cache, [leaf])
    cache.unlock(leaf)  # leaf, mid and top are all useless now
    assert not cache.root.children
    assert cache.kv_pool.num_free == cache.kv_pool.size
    check(cache)


def test_evicting_a_leaf_checkpoint_reclaims_leaf_and_useless_parents():
    cache = make_cache()
    a = [1, 1, 2, 3, 5, 8, 13]
    b = a[:3] + [50, 51]
    put(cache, a)
    put(cache, b)  # split at 3: tombstone-like parent without checkpoint
    cache.match(b, len(b))
    cache.evict_ckpts(1)  # a's checkpoint: a's leaf goes, the split node keeps b
    assert node_at(cache, a) is None and node_at(cache, a[:3]) is not None
    cache.evict_ckpts(1)
    assert not cache.root.children and cache.kv_pool.num_free == cache.kv_pool.size
    check(cache)


# ---- evict_kv ------------------------------------------------------------------------------------


def test_evict_kv_takes_unlocked_leaves_least_recently_used_first():
    cache = make_cache()
    a, b, c, d = [1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]
    na, _ = put(cache, a)
    nb, _ = put(cache, b)
    nc, _ = put(cache, c)
    nd, _ = put(cache, d)
    cache.match(a, len(a))  # a becomes the most recently used
    cache.lock(nb)  # b is not a candidate however old
    assert cache.evict_kv(1) == len(c)  # c: the oldest unlocked leaf (b is locked)
    assert node_at(cache, c) is None and node_at(cache, b) is nb
    assert cache.evict_kv(1) == len(d)
    assert node_at(cache, d) is None and node_at(cache, a) is na
    assert cache.evict_kv(1) == len(a)
    assert cache.evict_kv(100) == 0 and node_at(cache, b) is nb
    check(cache, [nb])
    cache.unlock(nb)
    check(cache)


def test_evict_kv_never_takes_an_inner_node_before_its_children():
    cache = make_cache()
    seq = list(range(60, 75))
    inner, inner_rows = put(cache, seq[:6])
    put(cache, seq)
    other, _ = put(cache, [1, 2])
    cache.match(seq[:6], 6)  # the inner node is recent; the leaf below it is older than `other`
    assert cache.evict_kv(1) == len(seq) - 6  # the deep leaf goes, its parent (a checkpoint) stays
    assert inner.ckpt is not None and is_attached(cache, inner) and inner.value == inner_rows
    assert node_at(cache, [1, 2]) is other
    check(cache)


def test_evict_kv_continues_past_a_reclaimed_tombstone():
    """Regression: a parent reclaimed by the cascade was queued again and evicted twice."""
    cache = make_cache()
    seq = list(range(10))
    put(cache, seq[:5])
    put(cache, seq)
    put(cache, [50, 51, 52])
    cache.match(seq, 10)
    assert cache.evict_ckpts(1) == 1  # seq[:5] -> tombstone with one child
    assert cache.evict_kv(100) == 13
    assert not cache.root.children and cache.kv_pool.num_free == cache.kv_pool.size
    check(cache)


def test_alloc_rows_evicts_and_refuses_without_taking_anything():
    cache = make_cache(num_rows=10)
    n1, _ = put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7])
    cache.lock(n1)
    rows = cache.alloc_rows(6)  # 3 free + the unlocked 3-row leaf
    assert rows is not None and len(rows) == 6 and node_at(cache, [5, 6, 7]) is None
    assert cache.alloc_rows(1) is None  # only the locked leaf is left
    assert cache.kv_pool.num_free == 0
    cache.check_integrity(rows, [], [n1], [])
    cache.kv_pool.free(rows)
    cache.unlock(n1)
    check(cache)


# ---- evict_ckpts ---------------------------------------------------------------------------------


def test_evict_ckpts_skips_ckpt_locked_and_orders_by_ckpt_access():
    cache = make_cache(num_ckpts=3)
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    nodes = [put(cache, s)[0] for s in seqs]
    cache.match(seqs[0], 3)  # consumed: the newest now
    cache.lock_ckpt(nodes[1])  # oldest, but being loaded
    slot = cache.alloc_ckpt()  # pool is full: must evict the oldest unlocked, seqs[2]
    assert slot is not None and node_at(cache, seqs[2]) is None
    assert nodes[1].ckpt is not None and nodes[0].ckpt is not None
    cache.check_integrity([], [slot], [], [nodes[1]])
    assert cache.evict_ckpts(5) == 1  # only seqs[0] is evictable
    assert nodes[1].ckpt is not None and is_attached(cache, nodes[1])
    slot2 = cache.alloc_ckpt()  # the one seqs[0] gave back
    assert slot2 is not None and nodes[0].ckpt is None
    assert cache.alloc_ckpt() is None  # the only checkpoint left is locked
    cache.check_integrity([], [slot, slot2], [], [nodes[1]])
    cache.unlock_ckpt(nodes[1])
    cache.ckpt_pool.free([slot, slot2])
    cache.flush()
    assert not cache.root.children


def test_a_hit_touches_only_the_consumed_checkpoint_not_its_ancestors():
    """SGLang PR #31643: an ancestor whose state was not consumed is evicted before the
    consumed deeper one, and before an unrelated entry inserted after the ancestor."""
    cache = make_cache(num_ckpts=8)
    conv = list(range(200, 230))
    ancestor, _ = put(cache, conv[:12])
    deeper, _ = put(cache, conv)
    unrelated, _ = put(cache, [7, 7, 7, 7])
    hit = cache.match(conv + [1], len(conv))
    assert hit.node is deeper
    order = []
    for _ in range(3):
        before = {id(n): n.ckpt for n in (ancestor, deeper, unrelated)}
        assert cache.evict_ckpts(1) == 1
        order += [n for n in (ancestor, deeper, unrelated)
                  if before[id(n)] is not None and n.ckpt is None]
    assert order == [ancestor, unrelated, deeper]
    check(cache)


def test_flush_keeps_only_what_requests_hold():
    cache = make_cache()
    held, rows = put(cache, [1, 2, 3, 4, 5])
    loading, _ = put(cache, [9, 9, 9])
    put(cache, [1, 2, 3, 7])
    put(cache, [4, 4])
    cache.lock(held)
    cache.lock(loading)
    cache.lock_ckpt(loading)
    cache.flush()
    assert held.ckpt is None and cache.rows_to(held) == rows and is_attached(cache, held)
    assert loading.ckpt is not None
    assert set(tree_paths(cache)) == {(), (1, 2, 3), (1, 2, 3, 4, 5), (9, 9, 9)}
    check(cache, [held, loading], [loading])
    cache.unlock_ckpt(loading)
    cache.unlock(loading)
    cache.unlock(held)
    cache.flush()
    assert not cache.root.children
    assert cache.kv_pool.num_free == cache.kv_pool.size
    assert cache.ckpt_pool.num_free == cache.ckpt_pool.size


def test_unbalanced_unlocks_raise():
    cache = make_cache()
    node, _ = put(cache, [1, 2])
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock_ckpt(node)
