"""Checkpoint eviction by value (``RadixCache(checkpoint_eviction="reuse")``): a full
pool drops the checkpoint whose hit saves least over its nearest cached ancestor, weighed with
recency; ``lru`` keeps dropping the least recently hit one."""

from __future__ import annotations

import pytest
from support.radix_helpers import put

from scheduler.index_pool import IndexPool
from scheduler.radix_cache import RadixCache


def tree(eviction: str) -> tuple[RadixCache, list[int]]:
    """A shared 64-token prefix checkpointed first (oldest), then two prompts that extend it by
    4 tokens each, checkpointed at their ends; the pool (3 slots) is full."""
    cache = RadixCache(IndexPool(256), IndexPool(3), eviction)
    shared = list(range(1, 65))
    put(cache, shared)
    put(cache, shared + [100, 101, 102, 103])
    put(cache, shared + [200, 201, 202, 203])
    return cache, shared


def cached_depths(cache: RadixCache) -> list[int]:
    return sorted(n.depth for n in cache._nodes() if n.ckpt is not None)


def test_lru_drops_the_oldest_even_when_it_saves_the_most():
    cache, _ = tree("lru")
    assert cache.evict_ckpts(1) == 1
    assert cached_depths(cache) == [68, 68]
    cache.check_integrity([], [], [], [])


def test_reuse_keeps_the_shared_prefix_and_drops_an_end_checkpoint():
    cache, shared = tree("reuse")
    assert cache.evict_ckpts(1) == 1
    assert cached_depths(cache) == [64, 68]
    cache.check_integrity([], [], [], [])
    # the older of the two end checkpoints went (equal savings: recency decides)
    assert cache.match(shared + [100, 101, 102, 103, 7], 69).length == 64
    assert cache.match(shared + [200, 201, 202, 203, 7], 69).length == 68


def test_reuse_still_drops_a_valuable_checkpoint_nobody_touched_for_long():
    """Recency counts too: a deep checkpoint far older than many shallow recent ones goes."""
    cache = RadixCache(IndexPool(512), IndexPool(6), "reuse")
    put(cache, list(range(1, 41)))  # saves 40, oldest
    for i in range(5):  # five recent ones, each saving 36
        put(cache, [90 + i] + list(range(1, 36)))
    cache.evict_ckpts(1)
    assert 40 not in cached_depths(cache)


def test_unknown_eviction_is_refused():
    with pytest.raises(ValueError, match="checkpoint eviction"):
        RadixCache(IndexPool(4), IndexPool(2), "lfu")
