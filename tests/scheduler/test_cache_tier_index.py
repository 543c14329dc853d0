"""The second cache tier's index (scheduler/cache_tier.py) on real files: the prefix lookup,
the byte budget and both eviction orders, the log a restart replays (torn lines, missing and
stray files), and the directory a fingerprint names.  The entry files stand in for what the
ranks write (model_runner/tier_store.py: its own tests are the served ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.scheduler_helpers import make_tier

from scheduler.cache_tier import CacheTier, PrefixIndex, TierEntry
from scheduler.wire.serve_config import CacheTierConfig


def spill_written(tier: CacheTier, tokens: list[int]) -> TierEntry:
    """Spill ``tokens`` and write every rank's file, as the ranks would."""
    assert tier.spill(tokens, 0, list(range(len(tokens))))
    (move,), _ = tier.take_moves()
    for r in range(tier.tp_size):
        tier.path(move.entry, r).write_bytes(b"x")
    tier.written([move.entry], [])
    return tier.entries[move.entry]


def test_the_deepest_entry_a_prompt_starts_with():
    index = PrefixIndex()
    entries = [TierEntry(i, tuple(t), 1, 0, ready=True)
               for i, t in enumerate([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9], [7]])]
    for e in entries:
        index.insert(e)
    def deepest(tokens, max_len):
        found = index.entries_along(tokens, max_len)
        return found[-1] if found else None

    assert deepest([1, 2, 3, 4, 5, 6], 10) is entries[1]
    assert deepest([1, 2, 3, 4, 5, 6], 4) is entries[0]  # within max_len
    assert deepest([1, 2, 9, 9], 10) is entries[2]
    assert deepest([1, 2], 10) is None and deepest([8], 10) is None
    assert index.below(entries[1]) == 3 and index.below(entries[0]) == 0
    assert index.at((1, 2, 3)).entry is entries[0] and index.at((1, 2)).entry is None
    assert index.at((1, 2, 3, 4)) is None  # inside an edge
    index.remove(entries[0])
    assert deepest([1, 2, 3, 4], 10) is None
    assert deepest([1, 2, 3, 4, 5], 10) is entries[1]


def test_a_pending_entry_is_no_hit_until_every_rank_wrote_it(tmp_path):
    tier = make_tier(tmp_path, budget=10_000, tp_size=2)
    assert tier.spill([1, 2, 3], 0, [0, 1, 2])
    assert tier.deepest([1, 2, 3, 4], 4) is None and tier.has_pending
    assert not tier.spill([1, 2, 3], 0, [0, 1, 2])  # known: not spilled twice
    (move,), _ = tier.take_moves()
    tier.written([move.entry], [])
    assert tier.deepest([1, 2, 3, 4], 4).id == move.entry and not tier.has_pending
    assert tier.spill([5, 6], 0, [0, 1])
    (failed,), _ = tier.take_moves()
    tier.written([], [failed.entry])
    assert tier.deepest([5, 6, 7], 3) is None and tier.stats.spill_failed == 1


@pytest.mark.parametrize("eviction", ["lru", "reuse"])
def test_a_full_tier_evicts_by_the_chosen_order(tmp_path, eviction):
    """Entries cost 100 bytes + one a token.  ``base`` is the oldest and saves 300 tokens in
    400 bytes; ``tail`` continues it by 10 tokens (10 saved in 410 bytes).  lru drops ``base``;
    reuse (recency rank + tokens saved per byte) drops ``tail``."""
    tier = make_tier(tmp_path, budget=1300, eviction=eviction)
    base = spill_written(tier, list(range(300)))
    tail = spill_written(tier, list(range(310)))
    others = [spill_written(tier, [i] * 50) for i in (7, 8, 9)]
    new = spill_written(tier, [5] * 100)  # 1,460 bytes > 1,300: one entry goes
    evicted = base if eviction == "lru" else tail
    assert set(tier.entries.values()) == {base, tail, *others, new} - {evicted}
    assert tier.stats.evicted == 1 and not tier.path(evicted.id, 0).exists()


def test_an_entry_being_fetched_or_larger_than_the_budget_stays_out_of_eviction(tmp_path):
    tier = make_tier(tmp_path, budget=500)
    held = spill_written(tier, list(range(300)))  # 400 bytes
    tier.start_fetch(held)
    assert not tier.spill([5] * 200, 0, list(range(200)))  # 300 more: nothing may go
    assert not tier.spill([6] * 1000, 0, list(range(1000)))  # larger than the whole budget
    assert held.id in tier.entries and not tier.moves


def test_a_restart_replays_the_index(tmp_path):
    tier = make_tier(tmp_path, budget=10_000, tp_size=2)
    kept = [spill_written(tier, [i] * (10 + i)) for i in range(5)]
    gone = kept.pop(1)
    tier.drop(gone)  # evicted: a "del" record
    pending = tier.spill([42] * 12, 0, list(range(12)))  # written by no rank yet
    assert pending
    root = tier.root
    (root / "rank-1" / "0000000000000063.tmp").write_bytes(b"half")  # a crash mid-write
    lost = kept.pop()  # its rank-1 file vanished
    tier.path(lost.id, 1).unlink()
    with open(root / "index.log", "a") as f:
        f.write("0badf00d {\"put\": 77, \"tokens\": [1, 2")  # torn by a crash mid-append
    again = make_tier(tmp_path, budget=10_000, tp_size=2)
    assert sorted(e.tokens for e in again.entries.values()) == sorted(e.tokens for e in kept)
    assert again.stats.restored == len(kept)
    names = {p.name for p in root.rglob("*") if p.is_file()}
    assert names == {"index.log"} | {again.path(e.id, r).name for e in kept for r in (0, 1)}
    fresh = spill_written(again, [3, 3, 3])
    assert fresh.id > max(e.id for e in kept)  # ids never reused
    again.close()
    third = make_tier(tmp_path, budget=10_000, tp_size=2)
    assert len(third.entries) == len(kept) + 1
    assert len((root / "index.log").read_text().splitlines()) == len(kept) + 2  # compacted


def test_a_tier_of_other_settings_is_named_and_left_alone(tmp_path, capsys):
    first = make_tier(tmp_path, budget=10_000)
    spill_written(first, [1, 2, 3])
    first.close()
    cfg = CacheTierConfig(cache_tier_dir=str(tmp_path), cache_tier_bytes=10_000,
                          cache_tier_eviction="lru")
    other = CacheTier.open(cfg, "e" * 64, 1, lambda n: 100 + n)
    assert not other.entries and other.root != first.root
    assert (first.root / "index.log").exists() and len(list(first.root.rglob("*.entry"))) == 1
    err = capsys.readouterr().err
    assert err.count("written by another model or other settings") == 1
    assert "tier-ffffffffffffffff" in err


def test_an_unwritable_directory_turns_the_tier_off(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = CacheTierConfig(cache_tier_dir=str(blocker / "tier"), cache_tier_bytes=10_000,
                          cache_tier_eviction="lru")
    assert CacheTier.open(cfg, "f" * 64, 1, lambda n: n) is None
    assert capsys.readouterr().err.count("is not writable") == 1


def test_flush_forgets_every_entry_and_deletes_its_files(tmp_path):
    tier = make_tier(tmp_path, budget=10_000)
    for i in range(3):
        spill_written(tier, [i] * 5)
    assert tier.spill([9] * 5, 0, list(range(5)))  # pending: deleted once written
    (move,), _ = tier.take_moves()
    tier.path(move.entry, 0).write_bytes(b"x")
    tier.drop_all()
    assert tier.deepest([0] * 6, 6) is None
    tier.written([move.entry], [])
    assert not tier.entries and not list(Path(tier.root).rglob("*.entry"))
