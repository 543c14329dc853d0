"""Hybrid radix prefix cache: token ids -> KV rows, plus linear-attention state checkpoints.

A node holds the KV rows of its edge (``key`` tokens -> ``value`` rows, page size 1) and
optionally one checkpoint slot: the recurrent state after the node's last token.  For a hybrid
model KV without the state at the same boundary is useless, so a match returns the deepest node
that holds a checkpoint.  Invariants (``check_integrity`` proves them after every operation in
the tests):

- a split never invents a checkpoint: the new parent has none (a state cannot be cut);
- a node whose checkpoint was evicted keeps its KV while a descendant or a request needs it;
- no useless leaves: a leaf holds a checkpoint or a request's lock, else it is reclaimed;
- ``lock_ref`` of a node = running requests whose locked node lies in its subtree (KV locks run
  to the root); ``ckpt_lock`` is on one node only and keeps its checkpoint from eviction.

A node may also hold a *parked* active slot: a finished request's own state slot, exact for the
node's tokens.  A hit there adopts it: no checkpoint load, no dasc-wr refresh.  A volatile tier
over the checkpoints: the oldest parked one goes back to ``slot_pool`` (the active slots) when
an admission finds no free slot, and any one goes with its node's KV.

Two LRU orders (PR #31643 of SGLang): ``kv_access`` is touched along a matched path and orders
leaf eviction; ``ckpt_access`` is touched only on the node whose checkpoint a hit consumes and
orders checkpoint eviction, which may take the checkpoint of any node (the node then stays as
a KV-only "tombstone" while it has children or locks).  ``checkpoint_eviction="reuse"`` orders
checkpoint eviction by value instead (``checkpoint_eviction.by_value``).
"""

from __future__ import annotations

import heapq
import itertools

from scheduler.checkpoint_eviction import by_value
from scheduler.index_pool import IndexPool
from scheduler.radix_node import InsertResult, MatchResult, Node, common_prefix
from scheduler.wire.serve_config import CheckpointEviction


class RadixCache:
    def __init__(self, kv_pool: IndexPool, ckpt_pool: IndexPool, checkpoint_eviction: str = "lru",
                 slot_pool: IndexPool | None = None):
        """``slot_pool``: the active state slots, where dropped parked slots go back (None: the
        cache parks nothing)."""
        if checkpoint_eviction not in tuple(CheckpointEviction):
            raise ValueError(f"checkpoint eviction must be one of {', '.join(CheckpointEviction)}, "
                             f"got {checkpoint_eviction!r}")
        self.kv_pool, self.ckpt_pool, self.slot_pool = kv_pool, ckpt_pool, slot_pool
        self._parked: dict[int, Node] = {}  # parked slot -> its node, oldest first
        self.checkpoint_eviction = checkpoint_eviction
        self.root = Node([], [], None, 0)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_kv_evicted = self.num_ckpt_evicted = 0
        # called with a node whose checkpoint is about to be evicted, while its rows and slot
        # still hold it (the second cache tier spills it: scheduler/cache_tier.py)
        self.on_drop_ckpt = None

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_len: int) -> MatchResult:
        """Deepest node with a checkpoint or a parked slot whose depth is at most ``max_len``."""
        path, best = self._walk(tokens, max_len)
        now = next(self._clock)
        rows: list[int] = []
        for n in path[:best]:
            n.kv_access = now
            rows.extend(n.value)
        if best == 0:
            return MatchResult(self.root, 0, [])
        hit = path[best - 1]
        hit.ckpt_access = now
        return MatchResult(hit, hit.depth, rows)

    def match_len(self, tokens: list[int], max_len: int) -> int:
        """What ``match`` would cover, without touching either LRU order (a policy's peek)."""
        path, best = self._walk(tokens, max_len)
        return path[best - 1].depth if best else 0

    def _walk(self, tokens: list[int], max_len: int) -> tuple[list[Node], int]:
        """The matched path of whole edges within ``max_len``, and how many of its nodes lead
        to (and include) the deepest one with a checkpoint or a parked slot."""
        node, pos, path, best = self.root, 0, [], 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or pos + len(child.key) > max_len:
                break
            if child.key != tokens[pos : pos + len(child.key)]:
                break
            node, pos = child, pos + len(child.key)
            path.append(node)
            if node.ckpt is not None or node.parked is not None:
                best = len(path)
        return path, best

    def cached_len(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds, a partial edge included: where
        they would branch off it.  Touches neither LRU order."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = common_prefix(child.key, tokens, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def ckpt_at(self, tokens: list[int]) -> int | None:
        """The checkpoint slot of the node ending exactly at len(tokens), if any."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or child.key != tokens[pos : pos + len(child.key)]:
                return None
            node, pos = child, pos + len(child.key)
        return node.ckpt if pos == len(tokens) else None

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        start = node
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock without lock")
            node.lock_ref -= 1
            node = node.parent
        self._prune(start)

    def lock_ckpt(self, node: Node) -> None:
        node.ckpt_lock += 1

    def unlock_ckpt(self, node: Node) -> None:
        if node.ckpt_lock <= 0:
            raise RuntimeError("unlock_ckpt without lock_ckpt")
        node.ckpt_lock -= 1

    # ---- parked active slots ------------------------------------------------------------------
    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def park(self, node: Node, slot: int) -> bool:
        """Leave ``slot`` (holding the exact state after ``node``'s tokens) at ``node``.  False:
        the node already has one, or the cache parks nothing; the caller frees ``slot``."""
        if self.slot_pool is None or node.parked is not None or node is self.root:
            return False
        node.parked = slot
        self._parked[slot] = node
        return True

    def unpark(self, node: Node) -> int:
        """Take the node's parked slot for a request that hits there (it owns it from now)."""
        slot = node.parked
        if slot is None:
            raise RuntimeError("unpark of a node without a parked slot")
        node.parked = None
        del self._parked[slot]
        return slot

    def drop_parked(self, num: int) -> int:
        """Free up to ``num`` parked slots into the slot pool, oldest first (a hit there takes
        its slot at once, so age is recency); returns how many."""
        dropped = list(itertools.islice(self._parked.values(), num))
        for node in dropped:
            self._drop_parked(node)
            self._prune(node)
        return len(dropped)

    def _drop_parked(self, node: Node) -> None:
        self.slot_pool.free([self.unpark(node)])

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, tokens: list[int], kv_rows: list[int], ckpt: int | None) -> InsertResult:
        """Cache [0, len(tokens)) with the caller's rows and, if given, a checkpoint at its end.
        Rows for tokens already cached are not adopted: the caller frees
        ``kv_rows[own_start:num_existing]`` for the part it owned, and uses ``result.kv_rows``."""
        if not tokens or len(tokens) != len(kv_rows):
            raise ValueError("insert needs tokens and one KV row per token")
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(list(tokens[pos:]), list(kv_rows[pos:]), node, len(tokens))
                new.kv_access = now
                node.children[tokens[pos]] = new
                node, num_existing = new, pos
                break
            common = common_prefix(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.kv_access = now
            node, pos = child, pos + common
        else:
            num_existing = len(tokens)
        taken = ckpt is not None and node.ckpt is None
        if taken:
            node.ckpt, node.ckpt_access = ckpt, now
        return InsertResult(node, num_existing, self.rows_to(node), taken)

    def tokens_to(self, node: Node) -> list[int]:
        return _along(node, "key")

    def checkpoint_nodes(self) -> list[Node]:
        """Every node holding a checkpoint, most recently hit first."""
        nodes = [n for n in self._nodes() if n.ckpt is not None]
        return sorted(nodes, key=lambda n: -n.ckpt_access)

    def rows_to(self, node: Node) -> list[int]:
        return _along(node, "value")

    def _split(self, child: Node, at: int) -> Node:
        """child (key k) -> parent (k[:at], no checkpoint) -> child (k[at:])."""
        parent = child.parent
        mid = Node(child.key[:at], child.value[:at], parent, parent.depth + at)
        mid.lock_ref, mid.kv_access = child.lock_ref, child.kv_access
        parent.children[child.key[0]] = mid
        child.key, child.value, child.parent = child.key[at:], child.value[at:], mid
        mid.children[child.key[0]] = child
        return mid

    # ---- allocation with eviction -------------------------------------------------------------
    def alloc_rows(self, n: int) -> list[int] | None:
        if self.kv_pool.num_free < n:
            self.evict_kv(n - self.kv_pool.num_free)
        return self.kv_pool.alloc(n)

    def alloc_ckpt(self) -> int | None:
        if self.ckpt_pool.num_free == 0:
            self.evict_ckpts(1)
        got = self.ckpt_pool.alloc(1)
        return got[0] if got else None

    def evict_kv(self, num_rows: int) -> int:
        """Free at least ``num_rows`` rows from unlocked leaves, least recently used first."""
        heap = [(n.kv_access, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_rows and heap:
            _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            freed += self._prune(parent)
            if parent.parent is not None and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.kv_access, parent))
        self.num_kv_evicted += freed
        return freed

    def evict_ckpts(self, num: int) -> int:
        """Drop ``num`` checkpoints not locked for loading, least recently consumed first (lru)
        or least valuable first (reuse)."""
        nodes = [n for n in self._nodes() if n.ckpt is not None and n.ckpt_lock == 0]
        if self.checkpoint_eviction == "reuse" and num < len(nodes):
            nodes = by_value(nodes)
        else:
            nodes.sort(key=lambda n: n.ckpt_access)
        for node in nodes[:num]:
            if self.on_drop_ckpt is not None:
                self.on_drop_ckpt(node)
            self.ckpt_pool.free([node.ckpt])
            node.ckpt = None
            self._prune(node)
        self.num_ckpt_evicted += min(num, len(nodes))
        return min(num, len(nodes))

    def flush(self) -> None:
        """Drop everything no running request holds (nothing is spilled)."""
        hook, self.on_drop_ckpt = self.on_drop_ckpt, None
        self.drop_parked(len(self._parked))
        self.evict_ckpts(self.ckpt_pool.size)
        self.on_drop_ckpt = hook

    def _is_evictable_leaf(self, n: Node) -> bool:
        return n.parent is not None and not n.children and n.lock_ref == 0 and n.ckpt_lock == 0

    def _remove_leaf(self, leaf: Node) -> int:
        if leaf.ckpt is not None and self.on_drop_ckpt is not None:
            self.on_drop_ckpt(leaf)
        del leaf.parent.children[leaf.key[0]]
        leaf.parent = None  # detached: evict_kv must not queue a node _prune already took
        self.kv_pool.free(leaf.value)
        if leaf.ckpt is not None:
            self.ckpt_pool.free([leaf.ckpt])
            self.num_ckpt_evicted += 1
        if leaf.parked is not None:
            self._drop_parked(leaf)
        return len(leaf.value)

    def _prune(self, node: Node) -> int:
        """Reclaim useless leaves (no checkpoint, parked slot or lock) from ``node`` upwards."""
        freed = 0
        while (node.parent is not None and not node.children and node.ckpt is None
               and node.parked is None and node.lock_ref == 0):
            parent = node.parent
            freed += self._remove_leaf(node)
            node = parent
        return freed

    # ---- introspection ------------------------------------------------------------------------
    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_cached_rows(self) -> int:
        return sum(len(n.value) for n in self._nodes())

    @property
    def num_cached_ckpts(self) -> int:
        return sum(n.ckpt is not None for n in self._nodes())

    def check_integrity(self, owned_rows: list[int], owned_ckpts: list[int],
                        locked: list[Node], ckpt_locked: list[Node],
                        owned_slots: list[int] | None = None) -> None:
        """Raise AssertionError unless the tree and the pools agree with what requests hold:
        every row / checkpoint slot is free, cached in exactly one node, or owned by one
        request; with ``owned_slots`` (the running requests' active slots), so is every active
        slot, a parked one in exactly one node."""
        expect_lock: dict[int, int] = {id(self.root): 1}
        for node in locked:
            while node is not None:
                expect_lock[id(node)] = expect_lock.get(id(node), 0) + 1
                node = node.parent
        expect_ckpt_lock: dict[int, int] = {}
        for node in ckpt_locked:
            expect_ckpt_lock[id(node)] = expect_ckpt_lock.get(id(node), 0) + 1
        rows, ckpts = list(owned_rows), list(owned_ckpts)
        parked = []
        for n in self._nodes():
            assert n.lock_ref == expect_lock.get(id(n), 0), "lock_ref mismatch"
            assert n.ckpt_lock == expect_ckpt_lock.get(id(n), 0), "ckpt_lock mismatch"
            rows.extend(n.value)
            if n.ckpt is not None:
                ckpts.append(n.ckpt)
            if n.parked is not None:
                parked.append(n.parked)
                assert self._parked.get(n.parked) is n, "a parked slot's node is not indexed"
            for first, child in n.children.items():
                assert child.parent is n and child.key and child.key[0] == first
                assert len(child.key) == len(child.value)
                assert child.depth == n.depth + len(child.key)
            if n.parent is not None and not n.children:
                assert n.ckpt is not None or n.parked is not None or n.lock_ref > 0, \
                    "useless leaf"
        assert len(parked) == len(self._parked), "the parked index names a node not in the tree"
        pools = [("KV row", rows, self.kv_pool), ("slot", ckpts, self.ckpt_pool)]
        if owned_slots is not None and self.slot_pool is not None:
            pools.append(("active slot", list(owned_slots) + parked, self.slot_pool))
        for name, held, pool in pools:
            assert len(held) == len(set(held)), f"a {name} is held twice"
            assert not set(held) & pool.free_ids(), f"a {name} is both free and held"
            assert len(held) + pool.num_free == pool.size, f"a {name} leaked"


def _along(node: Node, field: str) -> list[int]:
    """A node's ``key`` (tokens) or ``value`` (KV rows) edges from the root, joined."""
    parts = []
    while node is not None:
        parts.append(getattr(node, field))
        node = node.parent
    return [x for part in reversed(parts) for x in part]
