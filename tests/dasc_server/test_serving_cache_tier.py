"""The second cache tier through real servers (``--cache-tier-dir``): a checkpoint pool of two
slots evicts at once, so every prefix passes through the tier.  A tier hit gives the tokens of
no cache (dense) or of a pool hit in the same format (compressed); a restart finds the tier
again; each fault ends with correct tokens and one plain line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import zlib
from pathlib import Path

import httpx
import pytest
from support.serving import KIMI, running_server
from support.serving_reference import Reference

from loadgen.spawn import descendants

MAX_TOKENS = 4
# four prompts of 300 tokens, none a prefix of another: with two checkpoint slots, each
# evicts the checkpoints of the one before it (256, 299 and the finished 303)
PROMPTS = [[40 + (i * 7 + j) % 80 for j in range(300)] for i in range(4)]
MORE = list(b" and then?")
TIER_FLAGS = ("--checkpoint-slots", "2", "--no-park-finished")


def ask(server, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens)."""
    body = server.complete(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def tier_stats(server) -> dict:
    return server.stats()["tier"]


def wait_written(server, entries: int, timeout: float = 30.0) -> dict:
    """The tier's stats once it holds ``entries`` written entries (writes leave the step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = tier_stats(server)
        if stats["entries"] >= entries:
            return stats
        time.sleep(0.1)
    pytest.fail(f"the tier holds {tier_stats(server)} after {timeout} s")


def fill(server) -> None:
    for prompt in PROMPTS:
        ask(server, prompt)
    wait_written(server, 6)


def index_entries(tier_dir: Path) -> list[dict]:
    """The live entries of the tier's index.log (lines ``<crc32 hex> <json>``)."""
    (root,) = tier_dir.glob("tier-*")
    live = {}
    for line in (root / "index.log").read_text().splitlines()[1:]:
        rec = json.loads(line.split(" ", 1)[1])
        if "put" in rec:
            live[rec["put"]] = rec
        else:
            live.pop(rec["del"], None)
    return list(live.values())


def entry_file(tier_dir: Path, prompt: list[int], rank: int = 0) -> Path:
    """The file of the deepest entry that ``prompt`` starts with."""
    (root,) = tier_dir.glob("tier-*")
    best = max((e for e in index_entries(tier_dir) if prompt[: len(e["tokens"])] == e["tokens"]),
               key=lambda e: len(e["tokens"]))
    return root / f"rank-{rank}" / f"{best['put']:016x}.entry"


@pytest.fixture(scope="module")
def reference():
    return Reference(KIMI)


def expected(reference, prompt: list[int]) -> list[int]:
    return reference.engine.generate([prompt], MAX_TOKENS)[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tier_hit_gives_the_tokens_of_no_cache(tmp_path, reference, tp):
    """Dense checkpoints: the prompt's prefix comes back from the tier (its KV rows and its
    checkpoint), then only the suffix is prefilled; the tokens equal an uncached run's."""
    with running_server("--model", str(KIMI), "--tp", str(tp), *TIER_FLAGS,
                        "--cache-tier-dir", str(tmp_path)) as server:
        fill(server)
        before = tier_stats(server)
        tokens, cached = ask(server, PROMPTS[0] + MORE)
        after = tier_stats(server)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert server.stats()["integrity"] == "ok"
    assert "dasc_tier_loads_total 1.0" in metrics and "dasc_tier_spills_total" in metrics
    assert before["fetches"] == 0 and after["fetches"] == 1 and after["fetch_failed"] == 0
    assert cached == len(PROMPTS[0]) - 1  # the prompt-end checkpoint, from the tier
    assert tokens == expected(reference, PROMPTS[0] + MORE)


def test_a_compressed_tier_hit_gives_the_tokens_of_a_pool_hit(tmp_path):
    """dasc-nr at W_max 16: the tier keeps the compressed slot byte for byte, so a hit there
    restores what a hit on the pool restores."""
    flags = ("--model", str(KIMI), "--wmax", "16")
    with running_server(*flags) as server:  # 64 slots: everything stays in the pool
        ask(server, PROMPTS[0])
        pool_hit = ask(server, PROMPTS[0] + MORE)
    with running_server(*flags, *TIER_FLAGS, "--cache-tier-dir", str(tmp_path)) as server:
        fill(server)
        tier_hit = ask(server, PROMPTS[0] + MORE)
        assert tier_stats(server)["fetches"] == 1
    assert pool_hit[1] == tier_hit[1] == len(PROMPTS[0]) - 1
    assert tier_hit[0] == pool_hit[0]


@pytest.fixture(scope="module")
def written_tier(tmp_path_factory, reference):
    """A tier written by one server and flushed by a SIGTERM to its whole process group (as
    systemd and ``docker stop`` send it); with the answers it gave to each prompt + MORE."""
    tier_dir = tmp_path_factory.mktemp("tier")
    with running_server("--model", str(KIMI), *TIER_FLAGS,
                        "--cache-tier-dir", str(tier_dir)) as server:
        fill(server)
        answers = [ask(server, p + MORE)[0] for p in PROMPTS[:2]]
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0
        log = server.log()
    assert "entries" in log and "kept" in log, log
    return tier_dir, answers


def restarted(tier_dir: Path, *flags: str):
    return running_server("--model", str(KIMI), *TIER_FLAGS, "--cache-tier-dir",
                          str(tier_dir), *flags)


def test_a_restart_replays_the_same_tokens_from_the_tier(written_tier, tmp_path, reference):
    tier_dir, answers = written_tier
    copy = tmp_path / "tier"
    shutil.copytree(tier_dir, copy)
    with restarted(copy) as server:
        restored = tier_stats(server)["restored"]
        replay = [ask(server, p + MORE) for p in PROMPTS[:2]]
        stats = tier_stats(server)
        assert server.stats()["integrity"] == "ok"
    assert restored >= 6
    assert [tokens for tokens, _ in replay] == answers
    assert all(cached >= len(PROMPTS[0]) - 1 for _, cached in replay)
    assert stats["fetches"] == 2 and stats["fetch_failed"] == 0
    assert answers[0] == expected(reference, PROMPTS[0] + MORE)


@pytest.mark.parametrize("fault", ["truncated", "flipped byte"])
def test_a_damaged_entry_is_dropped_and_the_request_prefills(written_tier, tmp_path,
                                                             reference, fault):
    tier_dir, answers = written_tier
    copy = tmp_path / "tier"
    shutil.copytree(tier_dir, copy)
    damaged = entry_file(copy, PROMPTS[0] + MORE)
    data = bytearray(damaged.read_bytes())
    if fault == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with restarted(copy) as server:
        tokens, cached = ask(server, PROMPTS[0] + MORE)
        stats = tier_stats(server)
        again = ask(server, PROMPTS[0] + MORE)
        log = server.log()
        assert server.stats()["integrity"] == "ok"
    assert tokens == answers[0] == again[0]
    assert stats["fetch_failed"] == 1 and not damaged.exists()
    said = "truncated" if fault == "truncated" else "fails its checksum"
    assert log.count("cache tier:") >= 1 and log.count(said) == 1, log


def test_a_tier_from_other_settings_is_left_alone(written_tier, tmp_path, reference):
    """Another W_max is another fingerprint: the old tier is named once, neither read nor
    deleted, and the server starts an empty one beside it."""
    tier_dir, _ = written_tier
    copy = tmp_path / "tier"
    shutil.copytree(tier_dir, copy)
    (old,) = copy.glob("tier-*")
    files = sorted(p.name for p in old.rglob("*"))
    with restarted(copy, "--wmax", "16") as server:
        stats = tier_stats(server)
        tokens, _ = ask(server, PROMPTS[0] + MORE)
        log = server.log()
    assert stats["restored"] == 0 and stats["directory"] != str(old)
    assert log.count("written by another model or other settings") == 1, log
    assert sorted(p.name for p in old.rglob("*")) == files
    assert len(tokens) == MAX_TOKENS


def test_a_kill_mid_write_then_a_restart_serves_correct_tokens(tmp_path, reference):
    """SIGKILL to every process right after the traffic (writes in flight, no flush), and a
    torn last line in the index: the restart keeps what was whole and serves correct tokens."""
    with running_server("--model", str(KIMI), *TIER_FLAGS,
                        "--cache-tier-dir", str(tmp_path)) as server:
        for prompt in PROMPTS:
            ask(server, prompt)
        for pid in [server.proc.pid, *descendants(server.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        server.proc.wait(30)
    (root,) = tmp_path.glob("tier-*")
    with open(root / "index.log", "a") as f:
        f.write(f"{zlib.crc32(b'x'):08x} {{\"put\": 99, \"tok")  # torn mid-append
    with restarted(tmp_path) as server:
        tokens, _ = ask(server, PROMPTS[1] + MORE)
        log = server.log()
        assert server.stats()["integrity"] == "ok"
    assert tokens == expected(reference, PROMPTS[1] + MORE)
    assert "torn" in log, log
    assert not list(root.rglob("*.tmp"))


def unshare_tmpfs(options: str) -> tuple[str, ...]:
    """A wrapper that runs the server in its own mount namespace with a tmpfs (``options``)
    at the path given as $DASC_TIER_MOUNT; skips where namespaces are not allowed."""
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)
    if probe.returncode != 0 or shutil.which("unshare") is None:
        pytest.skip("unshare -Urm is not allowed here")
    script = f'mount -t tmpfs -o {options} tmpfs "$DASC_TIER_MOUNT" && exec "$@"'
    return ("unshare", "-Urm", "sh", "-c", script, "sh")


def test_a_full_disk_drops_what_does_not_fit_and_keeps_serving(tmp_path, monkeypatch,
                                                               reference):
    monkeypatch.setenv("DASC_TIER_MOUNT", str(tmp_path))
    wrap = unshare_tmpfs("size=640k")  # two entries of ~270 kB
    with running_server("--model", str(KIMI), *TIER_FLAGS, "--cache-tier-dir", str(tmp_path),
                        wrap=wrap) as server:
        for prompt in PROMPTS:
            ask(server, prompt)
        deadline = time.monotonic() + 30
        while tier_stats(server)["spill_failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = tier_stats(server)
        answers = [ask(server, p + MORE)[0] for p in PROMPTS]
        log = server.log()
        assert server.stats()["integrity"] == "ok"
    assert stats["spill_failed"] >= 1 and stats["entries"] >= 1
    assert answers == [expected(reference, p + MORE) for p in PROMPTS]
    assert log.count("No space left on device") == 1, log


def test_a_tier_directory_that_cannot_be_written_is_named_once(tmp_path, monkeypatch,
                                                              reference):
    monkeypatch.setenv("DASC_TIER_MOUNT", str(tmp_path))
    wrap = unshare_tmpfs("ro,size=1m")
    with running_server("--model", str(KIMI), *TIER_FLAGS, "--cache-tier-dir", str(tmp_path),
                        wrap=wrap) as server:
        answers = [ask(server, p)[0] for p in PROMPTS[:2]]
        stats = server.stats()
        log = server.log()
    assert stats["tier"] is None
    assert log.count("is not writable") == 1, log
    assert answers == [expected(reference, p) for p in PROMPTS[:2]]


def test_sigterm_to_the_launcher_writes_the_pool_into_the_tier(tmp_path):
    """With room for everything in the pool nothing is evicted; the shutdown writes what the
    pool holds, so the next start finds it."""
    with running_server("--model", str(KIMI), "--cache-tier-dir", str(tmp_path)) as server:
        for prompt in PROMPTS[:2]:
            ask(server, prompt)
        assert tier_stats(server)["spills"] == 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        log = server.log()
    assert "before exit" in log and "kept" in log, log
    stored = [e["tokens"] for e in index_entries(tmp_path)]
    for prompt in PROMPTS[:2]:
        assert prompt[:-1] in stored  # the prompt-end checkpoint
    with restarted(tmp_path) as server:
        _, cached = ask(server, PROMPTS[1] + MORE)
    assert cached >= len(PROMPTS[1]) - 1


@pytest.mark.parametrize("tp", [1, 2])
def test_a_host_memory_tier_hit_gives_the_tokens_of_no_cache(reference, tp):
    """``--host-tier-bytes``: the same entries kept in each rank's memory instead of files."""
    with running_server("--model", str(KIMI), "--tp", str(tp), *TIER_FLAGS,
                        "--host-tier-bytes", "64M") as server:
        fill(server)
        tokens, cached = ask(server, PROMPTS[0] + MORE)
        stats = tier_stats(server)
        assert server.stats()["integrity"] == "ok"
    assert stats["directory"] == "host memory" and stats["fetches"] == 1
    assert cached == len(PROMPTS[0]) - 1
    assert tokens == expected(reference, PROMPTS[0] + MORE)


def test_a_full_host_memory_tier_evicts_and_stays_exact(reference):
    """Room for seven entries of ~270 kB: the four prompts fill it, their follow-ups hit it and
    make it evict (the ranks drop those entries), and every answer stays exact."""
    with running_server("--model", str(KIMI), *TIER_FLAGS, "--host-tier-bytes", "2M") as server:
        for prompt in PROMPTS:
            ask(server, prompt)
        answers = [ask(server, p + MORE) for p in PROMPTS]
        stats = tier_stats(server)
        assert server.stats()["integrity"] == "ok"
    assert stats["evicted"] > 0 and stats["bytes"] <= 2 * 2**20
    assert stats["fetches"] >= 1 and answers[0][1] >= 256  # from the tier: the pool holds P3
    assert [tokens for tokens, _ in answers] == [expected(reference, p + MORE) for p in PROMPTS]
