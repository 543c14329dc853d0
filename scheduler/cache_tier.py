"""The second cache tier: prefixes the checkpoint pool evicted, kept as files, found again after
a restart.

An entry is one prefix: its tokens, and on every rank one file with the prefix's KV rows and one
checkpoint slot in the server's format (``model_runner/tier_store.py`` writes and reads them).
The scheduler owns the index; the ranks own the bytes.

- **Spill.** When the radix cache drops a checkpoint (``RadixCache.on_drop_ckpt``), the prefix
  gets an entry unless one exists: the next plan's ``spills`` copy its rows and slot out at the
  start of the step, before anything can reuse them, and each rank writes its file in the
  background.  An entry is *pending* until every rank has reported its file written
  (``StepResult.tier_written``), and only then a hit.
- **Fetch.** An admission whose deepest match is an entry at least ``MIN_BRANCH_GAIN`` tokens
  deeper than the radix cache's plans a fetch into fresh rows and a checkpoint slot and waits
  one step; the result puts the prefix into the radix tree with that checkpoint, and the
  request is admitted as an ordinary hit.  A fetch that fails a check on any rank drops the
  entry: the request prefills.
- **Budget.** Entries, pending ones included, fit ``--cache-tier-bytes``; a new one evicts
  ready entries nothing is fetching, by ``--cache-tier-eviction``.
- **Index** (``index.log``): one line per change, ``<crc32 hex> <json>``, appended and fsynced
  when entries become ready or go; the first line names the fingerprint.  A line that fails its
  checksum (a crash mid-append) ends the replay; entries whose files are missing are dropped,
  files no entry names are deleted.  Compacted at shutdown.
- **Fingerprint.** Rank 0 reports a digest of the model, weights, TP degree, selection plan and
  checkpoint format (``RankInfo.tier_fingerprint``); the tier lives in ``DIR/tier-<digest>``, so
  a tier written under other settings is never read, never deleted, and named once at start.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from scheduler.checkpoint_eviction import recency_ranks
from scheduler.radix_node import common_prefix
from scheduler.wire.messages import TierStats
from scheduler.wire.rank_messages import TierMove
from scheduler.wire.serve_config import CacheTierConfig, TierEviction

INDEX_VERSION = 1
ENTRY_OVERHEAD = 4096  # header and checksum, per rank file (an estimate)


def tell(message: str) -> None:
    print(f"cache tier: {message}", file=sys.stderr, flush=True)


@dataclass(slots=True, eq=False)
class TierEntry:
    id: int
    tokens: tuple[int, ...]
    nbytes: int
    access: int
    ready: bool = False
    fetching: int = 0  # fetches in flight
    dropped: bool = False  # evicted or flushed while pending: deleted once written


class _Branch:
    """A node of ``PrefixIndex``: an edge of tokens, and the entry ending there."""

    __slots__ = ("key", "parent", "children", "entry")

    def __init__(self, key: list[int], parent: _Branch | None):
        self.key, self.parent = key, parent
        self.children: dict[int, _Branch] = {}
        self.entry: TierEntry | None = None


class PrefixIndex:
    """Entries by token prefix, a compressed trie: the deepest entry a prompt starts with."""

    def __init__(self):
        self.root = _Branch([], None)

    def insert(self, entry: TierEntry) -> None:
        tokens, node, pos = list(entry.tokens), self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = _Branch(tokens[pos:], node)
                node.children[tokens[pos]] = child
                node, pos = child, len(tokens)
                break
            common = common_prefix(child.key, tokens, pos)
            if common < len(child.key):
                mid = _Branch(child.key[:common], node)
                node.children[tokens[pos]] = mid
                child.key, child.parent = child.key[common:], mid
                mid.children[child.key[0]] = child
                child = mid
            node, pos = child, pos + common
        node.entry = entry

    def remove(self, entry: TierEntry) -> None:
        node = self.at(entry.tokens)
        if node is None or node.entry is not entry:
            return
        node.entry = None
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.key[0]]
            node = node.parent

    def at(self, tokens) -> _Branch | None:
        """The node ending exactly at ``tokens`` (None: no edge ends there)."""
        tokens = list(tokens)
        for node, depth in self._walk(tokens, len(tokens)):
            if depth == len(tokens):
                return node
        return None

    def entries_along(self, tokens: list[int], max_len: int) -> list[TierEntry]:
        """The entries whose tokens lead ``tokens`` within ``max_len``, shallowest first."""
        return [n.entry for n, _ in self._walk(tokens, max_len) if n.entry is not None]

    def below(self, entry: TierEntry) -> int:
        """Tokens of the deepest other entry that leads this one (0: none)."""
        found = self.entries_along(list(entry.tokens), len(entry.tokens) - 1)
        return len(found[-1].tokens) if found else 0

    def _walk(self, tokens: list[int], max_len: int):
        """(node, depth) along whole edges that ``tokens`` matches, within ``max_len``."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or pos + len(child.key) > max_len:
                return
            if child.key != tokens[pos : pos + len(child.key)]:
                return
            node, pos = child, pos + len(child.key)
            yield node, pos


def _line(record: dict) -> str:
    text = json.dumps(record, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x} {text}\n"


def _parse(line: str) -> dict | None:
    """A record, or None for a line that fails its checksum (torn by a crash)."""
    crc, _, text = line.rstrip("\n").partition(" ")
    try:
        if int(crc, 16) != zlib.crc32(text.encode()):
            return None
        return json.loads(text)
    except ValueError:
        return None


class CacheTier:
    """The scheduler's index of the tier in ``root`` (``DIR/tier-<fingerprint>``)."""

    def __init__(self, root: Path | None, fingerprint: str, tp_size: int, budget: int,
                 eviction: TierEviction, entry_bytes):
        """``root`` None: the entries live in the ranks' host memory (``--host-tier-bytes``),
        no file and no index.  ``entry_bytes(num_tokens)``: an entry's bytes, every rank's part
        together."""
        self.root, self.fingerprint, self.tp_size = root, fingerprint, tp_size
        self.budget, self.eviction, self.entry_bytes = budget, eviction, entry_bytes
        self.entries: dict[int, TierEntry] = {}
        self.index = PrefixIndex()
        self.moves: list[TierMove] = []  # the next plan's spills
        self.freed: list[int] = []  # host-memory entries the ranks drop with the next plan
        self.stats = TierStats(str(root) if root is not None else "host memory", budget)
        self._next_id = 1
        self._clock = 0
        self._bytes = 0  # of every entry, pending ones included
        self._pending = 0  # entries not yet written by every rank
        self._log = None
        self._log_lines = 0

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, cfg: CacheTierConfig, fingerprint: str, tp_size: int,
             entry_bytes) -> CacheTier | None:
        """The tier for this fingerprint under ``cfg.cache_tier_dir``, its entries restored; None
        (after one line saying why) when the directory cannot be written.  With
        ``cfg.host_tier_bytes``: an empty tier in the ranks' host memory."""
        if cfg.host_tier_bytes is not None:
            return cls(None, fingerprint, tp_size, cfg.host_tier_bytes, cfg.cache_tier_eviction,
                       entry_bytes)
        base = Path(cfg.cache_tier_dir)
        root = base / f"tier-{fingerprint[:16]}"
        try:
            for r in range(tp_size):
                (root / f"rank-{r}").mkdir(parents=True, exist_ok=True)
            probe = root / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            tell(f"{base} is not writable ({type(e).__name__}: {e.strerror or e}); serving "
                 f"without a second tier")
            return None
        others = sorted(p.name for p in base.glob("tier-*") if p.name != root.name)
        if others:
            tell(f"{base} also holds {len(others)} tier(s) written by another model or other "
                 f"settings ({', '.join(others)}); left as they are, not loaded")
        tier = cls(root, fingerprint, tp_size, cfg.cache_tier_bytes, cfg.cache_tier_eviction,
                   entry_bytes)
        tier._restore()
        return tier

    def path(self, entry: int, rank: int) -> Path:
        return self.root / f"rank-{rank}" / f"{entry:016x}.entry"

    def _restore(self) -> None:
        """Replay ``index.log``; keep entries whose files all exist, delete the rest."""
        log = self.root / "index.log"
        records, torn = [], False
        if log.exists():
            with open(log, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
            head = _parse(lines[0]) if lines else None
            if (head is None or head.get("fingerprint") != self.fingerprint
                    or head.get("version") != INDEX_VERSION):
                tell(f"{log}: unreadable header; starting the tier empty")
                lines = []
            for line in lines[1:]:
                rec = _parse(line)
                if rec is None:
                    torn = True
                    break
                records.append(rec)
        live: dict[int, dict] = {}
        for rec in records:
            if "put" in rec:
                live[rec["put"]] = rec
            else:
                live.pop(rec.get("del"), None)
        for rec in live.values():
            entry = TierEntry(rec["put"], tuple(rec["tokens"]), rec["bytes"], self._tick(),
                              ready=True)
            if all(self.path(entry.id, r).is_file() for r in range(self.tp_size)):
                self._add(entry)
            self._next_id = max(self._next_id, entry.id + 1)
        names = {self.path(e, r).name for e in self.entries for r in range(self.tp_size)}
        stray = [p for r in range(self.tp_size) for p in (self.root / f"rank-{r}").iterdir()
                 if p.name not in names]
        for p in stray:
            p.unlink(missing_ok=True)
        lost = len(live) - len(self.entries)
        self.stats.restored = len(self.entries)
        if records or stray or torn:
            tell(f"{self.root}: {len(self.entries)} entries restored ({self._used() / 2**20:.1f}"
                 f" MiB)" + (f", {lost} without their files dropped" if lost else "")
                 + (f", {len(stray)} unfinished files deleted" if stray else "")
                 + (", the index's last line was torn and is ignored" if torn else ""))
        self._rewrite()

    # ---- lookups ------------------------------------------------------------------------------
    def deepest(self, tokens: list[int], max_len: int) -> TierEntry | None:
        """The deepest ready entry leading ``tokens`` within ``max_len``."""
        ready = [e for e in self.index.entries_along(tokens, max_len) if e.ready]
        return ready[-1] if ready else None

    @property
    def has_moves(self) -> bool:
        """Spills or host-memory drops for the ranks."""
        return bool(self.moves or self.freed)

    @property
    def has_pending(self) -> bool:
        return self._pending > 0

    # ---- spills -------------------------------------------------------------------------------
    def spill(self, tokens: list[int], slot: int, rows: list[int]) -> bool:
        """Queue an entry for ``tokens`` (KV ``rows``, checkpoint ``slot``) for the next plan;
        False when the tier has it already or it does not fit."""
        node = self.index.at(tokens)
        if node is not None and node.entry is not None:
            node.entry.access = self._tick()
            return False
        nbytes = self.entry_bytes(len(tokens))
        if not self._make_room(nbytes):
            return False
        entry = TierEntry(self._next_id, tuple(tokens), nbytes, self._tick())
        self._next_id += 1
        self._add(entry)
        self.moves.append(TierMove(entry.id, slot, list(rows)))
        return True

    def take_moves(self) -> tuple[list[TierMove], list[int]]:
        """(spills, dropped host-memory entries) for the next plan."""
        moves, freed, self.moves, self.freed = self.moves, self.freed, [], []
        return moves, freed

    def written(self, ids: list[int], failed: list[int]) -> None:
        """Spilled entries now on every rank's disk (``ids``) or failed on one."""
        records = []
        for i in ids:
            entry = self.entries.get(i)
            if entry is None:
                continue
            if entry.dropped:
                self._remove(entry)
                continue
            entry.ready = True
            self._pending -= 1
            self.stats.spills += 1
            self.stats.spill_bytes += entry.nbytes
            records.append({"put": entry.id, "tokens": list(entry.tokens),
                            "bytes": entry.nbytes})
        for i in failed:
            entry = self.entries.get(i)
            if entry is not None:
                self.stats.spill_failed += 1
                self._remove(entry)
        self._append(records)

    # ---- fetches ------------------------------------------------------------------------------
    def start_fetch(self, entry: TierEntry) -> None:
        entry.fetching += 1
        entry.access = self._tick()

    def fetched(self, entry: TierEntry, ok: bool, seconds: float) -> None:
        entry.fetching -= 1
        if ok:
            self.stats.fetches += 1
            self.stats.fetch_bytes += entry.nbytes
            self.stats.fetch_s += seconds
        else:
            self.stats.fetch_failed += 1
            self.drop(entry)

    # ---- eviction and flushing ----------------------------------------------------------------
    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.budget:
            return False
        used = self._used()
        if used + nbytes <= self.budget:
            return True
        victims = [e for e in self.entries.values() if e.ready and not e.fetching]
        for entry in self._eviction_order(victims):
            if used + nbytes <= self.budget:
                break
            used -= entry.nbytes
            self.stats.evicted += 1
            self.drop(entry)
        return used + nbytes <= self.budget

    def _eviction_order(self, entries: list[TierEntry]) -> list[TierEntry]:
        """lru: least recently used first.  reuse: lowest recency rank in [0, 1] plus the
        tokens a hit saves over the longest entry below it, per byte, normalised (the radix
        cache's ``by_value`` with the entry's own size: entries differ in length)."""
        if self.eviction is TierEviction.LRU or len(entries) < 2:
            return sorted(entries, key=lambda e: e.access)
        worth = {e.id: (len(e.tokens) - self.index.below(e)) / e.nbytes for e in entries}
        most = max(worth.values()) or 1.0
        rank = recency_ranks(entries, lambda e: e.access)
        return sorted(entries, key=lambda e: (rank[id(e)] + worth[e.id] / most, e.access))

    def drop_all(self) -> None:
        """Forget every entry and delete its files (``/flush_cache``)."""
        for entry in list(self.entries.values()):
            self.drop(entry)

    def close(self) -> None:
        """Compact the index (after the shutdown's spills are written)."""
        self._rewrite()
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---- books ----------------------------------------------------------------------------------
    def _used(self) -> int:
        return self._bytes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _add(self, entry: TierEntry) -> None:
        self.entries[entry.id] = entry
        self._bytes += entry.nbytes
        self._pending += not entry.ready
        self.index.insert(entry)

    def drop(self, entry: TierEntry) -> None:
        """Evicted or failed: gone now, its files deleted (once written, if pending)."""
        if not entry.ready:
            entry.dropped = True
            self.index.remove(entry)
            return
        self._remove(entry)
        self._append([{"del": entry.id}])

    def _remove(self, entry: TierEntry) -> None:
        if self.entries.pop(entry.id, None) is not None:
            self._bytes -= entry.nbytes
            self._pending -= not entry.ready
        self.index.remove(entry)
        if self.root is None:
            self.freed.append(entry.id)
            return
        for r in range(self.tp_size):
            self.path(entry.id, r).unlink(missing_ok=True)

    def _append(self, records: list[dict]) -> None:
        if not records or self.root is None:
            return
        if self._log is None:
            self._log = open(self.root / "index.log", "a", encoding="utf-8")
        self._log.write("".join(_line(r) for r in records))
        self._log.flush()
        os.fsync(self._log.fileno())
        self._log_lines += len(records)
        if self._log_lines > 2 * len(self.entries) + 1024:
            self._rewrite()

    def _rewrite(self) -> None:
        """The index as the live entries, written aside and renamed over the old one."""
        if self.root is None:
            return
        if self._log is not None:
            self._log.close()
            self._log = None
        records = [{"version": INDEX_VERSION, "fingerprint": self.fingerprint,
                    "tp": self.tp_size}]
        records += [{"put": e.id, "tokens": list(e.tokens), "bytes": e.nbytes}
                    for e in sorted(self.entries.values(), key=lambda e: e.access) if e.ready]
        tmp = self.root / "index.log.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(_line(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "index.log")
        self._log_lines = len(records) - 1

    def snapshot(self) -> TierStats:
        return replace(self.stats, entries=sum(e.ready for e in self.entries.values()),
                       bytes=self._bytes)
