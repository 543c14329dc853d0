"""Hybrid radix cache (scheduler/radix_cache.py): unit tests of every invariant, then seeded
random operation sequences with ``check_integrity`` after every operation and an independent
model of what each KV row and checkpoint slot holds."""

from __future__ import annotations

import random

import pytest

from scheduler.pools import IndexPool
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


# ---- seeded random operation sequences -----------------------------------------------------------


def prefix_hashes(tokens: list[int]) -> list[int]:
    """hs[i] identifies tokens[: i + 1] (what KV row i and a state after i + 1 tokens encode)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


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
