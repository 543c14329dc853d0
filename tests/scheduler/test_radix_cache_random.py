"""Hybrid radix cache (scheduler/radix_cache.py): seeded random operation sequences with
``check_integrity`` after every operation and an independent model of what each KV row and
checkpoint slot holds."""

from __future__ import annotations

import random

import pytest
from support.radix_helpers import is_attached, make_cache, node_at, prefix_hashes, tree_paths

from scheduler.radix_cache import Node


class User:
    """One caller of the cache: rows [0, cached_len) are the tree's (locked through ``node``),
    rows [cached_len, len(tokens)) are its own, and it 'computed' all of them."""

    def __init__(self, tokens, rows, cached_len, node):
        self.tokens, self.rows, self.cached_len, self.node = tokens, rows, cached_len, node


class RandomDriver:
    def __init__(self, seed: int, num_rows: int, num_ckpts: int):
        self.rng = random.Random(seed)
        self.cache = make_cache(num_rows, num_ckpts)
        self.users: list[User] = []
        self.free_ckpts: list[int] = []  # allocated, not yet given to the tree
        self.ckpt_locked: list[Node] = []
        self.row_hash: dict[int, int] = {}  # KV row -> hash of the prefix it encodes
        self.ckpt_hash: dict[int, tuple[int, int]] = {}  # slot -> (length, prefix hash)
        self.bases = [[self.rng.randrange(4) for _ in range(self.rng.randint(1, 30))]
                      for _ in range(6)]

    # what the caller owns, for check_integrity
    def owned_rows(self) -> list[int]:
        return [r for u in self.users for r in u.rows[u.cached_len :]]

    def check(self) -> None:
        c = self.cache
        c.check_integrity(self.owned_rows(), self.free_ckpts, [u.node for u in self.users],
                          self.ckpt_locked)
        for u in self.users:  # what a user holds never moves or vanishes
            assert is_attached(c, u.node) and u.node.depth == u.cached_len
            assert c.rows_to(u.node) == u.rows[: u.cached_len]
        for n in self.ckpt_locked:
            assert is_attached(c, n) and n.ckpt is not None

    def check_contents(self) -> None:
        """Every cached row and checkpoint encodes exactly its path in the tree."""
        for path, node in tree_paths(self.cache).items():
            if not path:
                continue
            hs = prefix_hashes(list(path))
            rows = self.cache.rows_to(node)
            assert [self.row_hash[r] for r in rows] == hs
            if node.ckpt is not None:
                assert self.ckpt_hash[node.ckpt] == (len(path), hs[-1])

    def random_tokens(self) -> list[int]:
        rng = self.rng
        toks = list(rng.choice(self.bases))
        if self.users and rng.random() < 0.3:  # continue someone's sequence
            toks = list(rng.choice(self.users).tokens)
        toks = toks[: rng.randint(0, len(toks))] + [rng.randrange(4)
                                                    for _ in range(rng.randint(0, 12))]
        return toks or [rng.randrange(4)]

    # ---- operations ----
    def op_new_user(self) -> None:
        c, rng = self.cache, self.rng
        toks = self.random_tokens()
        max_len = rng.randint(0, len(toks))
        hit = c.match(toks, max_len)
        expect = max((n for n in range(1, max_len + 1)
                      if (nd := node_at(c, toks[:n])) is not None and nd.ckpt is not None),
                     default=0)
        assert hit.length == expect and len(hit.kv_rows) == expect
        hs = prefix_hashes(toks)
        assert [self.row_hash[r] for r in hit.kv_rows] == hs[:expect]
        if expect:
            assert self.ckpt_hash[hit.node.ckpt] == (expect, hs[expect - 1])
        c.lock(hit.node)
        if expect and rng.random() < 0.5:  # "load" it while allocating
            c.lock_ckpt(hit.node)
            self.ckpt_locked.append(hit.node)
        rows = c.alloc_rows(len(toks) - expect)
        if rows is None:
            c.unlock(hit.node)
            return
        for i, r in enumerate(rows, start=expect):
            self.row_hash[r] = hs[i]  # the user computes its KV
        self.users.append(User(toks, hit.kv_rows + rows, expect, hit.node))

    def op_insert(self) -> None:
        c, rng = self.cache, self.rng
        cands = [u for u in self.users if u.cached_len < len(u.tokens)]
        if not cands:
            return
        u = rng.choice(cands)
        end = rng.randint(u.cached_len + 1, len(u.tokens))
        ckpt = None
        if rng.random() < 0.7:
            ckpt = self.free_ckpts.pop() if self.free_ckpts else c.alloc_ckpt()
        if ckpt is not None:
            self.ckpt_hash[ckpt] = (end, prefix_hashes(u.tokens[:end])[-1])
        res = c.insert(u.tokens[:end], u.rows[:end], ckpt)
        assert res.num_existing >= u.cached_len
        assert res.kv_rows[: u.cached_len] == u.rows[: u.cached_len]
        assert res.kv_rows[res.num_existing :] == u.rows[res.num_existing : end]
        if ckpt is not None and not res.ckpt_taken:
            assert res.node.ckpt is not None and res.node.ckpt != ckpt
            c.ckpt_pool.free([ckpt])
        dup = u.rows[u.cached_len : res.num_existing]
        c.kv_pool.free(dup)
        c.lock(res.node)
        c.unlock(u.node)
        u.rows, u.cached_len, u.node = res.kv_rows + u.rows[end:], end, res.node
        for r in dup:
            del self.row_hash[r]

    def op_release(self) -> None:
        if not self.users:
            return
        u = self.users.pop(self.rng.randrange(len(self.users)))
        self.cache.kv_pool.free(u.rows[u.cached_len :])
        self.cache.unlock(u.node)

    def op_lock_ckpt(self) -> None:
        nodes = [n for n in tree_paths(self.cache).values() if n.ckpt is not None]
        if nodes:
            node = self.rng.choice(nodes)
            self.cache.lock_ckpt(node)
            self.ckpt_locked.append(node)

    def op_unlock_ckpt(self) -> None:
        if self.ckpt_locked:
            node = self.ckpt_locked.pop(self.rng.randrange(len(self.ckpt_locked)))
            self.cache.unlock_ckpt(node)

    def op_alloc_ckpt(self) -> None:
        evictable = sum(n.ckpt is not None and n.ckpt_lock == 0
                        for n in tree_paths(self.cache).values())
        had_free = self.cache.ckpt_pool.num_free
        slot = self.cache.alloc_ckpt()
        assert (slot is None) == (had_free == 0 and evictable == 0)
        if slot is not None:
            self.free_ckpts.append(slot)

    def op_free_ckpt(self) -> None:
        if self.free_ckpts:
            self.cache.ckpt_pool.free([self.free_ckpts.pop()])

    def op_evict_kv(self) -> None:
        self.cache.evict_kv(self.rng.randint(1, 40))

    def op_evict_ckpts(self) -> None:
        c = self.cache
        evictable = sum(n.ckpt is not None and n.ckpt_lock == 0 for n in tree_paths(c).values())
        num = self.rng.randint(1, 4)
        assert c.evict_ckpts(num) == min(num, evictable)

    def op_flush(self) -> None:
        self.cache.flush()
        assert self.cache.num_cached_ckpts == len({id(n) for n in self.ckpt_locked})

    def step(self) -> None:
        ops = [(self.op_new_user, 5), (self.op_insert, 5), (self.op_release, 3),
               (self.op_lock_ckpt, 1), (self.op_unlock_ckpt, 1), (self.op_alloc_ckpt, 1),
               (self.op_free_ckpt, 1), (self.op_evict_kv, 1), (self.op_evict_ckpts, 1),
               (self.op_flush, 0.1)]
        op = self.rng.choices([o for o, _ in ops], [w for _, w in ops])[0]
        op()
        self.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_operation_sequences(seed):
    d = RandomDriver(seed, num_rows=120 + 40 * (seed % 3), num_ckpts=3 + 2 * (seed % 4))
    for i in range(2500):
        d.step()
        if i % 50 == 0:
            d.check_contents()
    d.check_contents()
    c = d.cache
    for node in d.ckpt_locked:
        c.unlock_ckpt(node)
    d.ckpt_locked = []
    while d.users:
        d.op_release()
        d.check()
    c.ckpt_pool.free(d.free_ckpts)
    d.free_ckpts = []
    d.check()
    assert c.kv_pool.num_free + c.num_cached_rows == c.kv_pool.size
    assert c.ckpt_pool.num_free + c.num_cached_ckpts == c.ckpt_pool.size
    c.flush()
    d.check()
    assert not c.root.children
    assert c.kv_pool.num_free == c.kv_pool.size and c.ckpt_pool.num_free == c.ckpt_pool.size
