"""The radix cache's integrity check (``RadixCache.check_integrity``): the tree, its locks and
the pools agree with what the running requests hold.  The tests run it after every operation."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.radix_cache import Node, RadixCache


def check_tree(cache: RadixCache, owned_rows: list[int], owned_ckpts: list[int],
               locked: list[Node], ckpt_locked: list[Node],
               owned_slots: list[int] | None = None) -> None:
    """Raise AssertionError unless the tree and the pools agree with what requests hold:
    every row / checkpoint slot is free, cached in exactly one node, or owned by one
    request; with ``owned_slots`` (the running requests' active slots), so is every active
    slot, a parked one in exactly one node."""
    expect_lock: dict[int, int] = {id(cache.root): 1}
    for node in locked:
        while node is not None:
            expect_lock[id(node)] = expect_lock.get(id(node), 0) + 1
            node = node.parent
    expect_ckpt_lock: dict[int, int] = {}
    for node in ckpt_locked:
        expect_ckpt_lock[id(node)] = expect_ckpt_lock.get(id(node), 0) + 1
    rows, ckpts = list(owned_rows), list(owned_ckpts)
    parked = []
    for n in cache._nodes():
        assert n.lock_ref == expect_lock.get(id(n), 0), "lock_ref mismatch"
        assert n.ckpt_lock == expect_ckpt_lock.get(id(n), 0), "ckpt_lock mismatch"
        rows.extend(n.value)
        if n.ckpt is not None:
            ckpts.append(n.ckpt)
        if n.parked is not None:
            parked.append(n.parked)
            assert cache._parked.get(n.parked) is n, "a parked slot's node is not indexed"
        for first, child in n.children.items():
            assert child.parent is n and child.key and child.key[0] == first
            assert len(child.key) == len(child.value)
            assert child.depth == n.depth + len(child.key)
        if n.parent is not None and not n.children:
            assert n.ckpt is not None or n.parked is not None or n.lock_ref > 0, \
                "useless leaf"
    assert len(parked) == len(cache._parked), "the parked index names a node not in the tree"
    pools = [("KV row", rows, cache.kv_pool), ("slot", ckpts, cache.ckpt_pool)]
    if owned_slots is not None and cache.slot_pool is not None:
        pools.append(("active slot", list(owned_slots) + parked, cache.slot_pool))
    for name, held, pool in pools:
        assert len(held) == len(set(held)), f"a {name} is held twice"
        assert not set(held) & pool.free_ids(), f"a {name} is both free and held"
        assert len(held) + pool.num_free == pool.size, f"a {name} leaked"
