"""A tiny ``dasc-bench matched-budget`` (dense + dasc-nr W_max 128, one seed, a dozen prompts,
TP=1): both arms start on the same budget with the slot counts the accounting predicts, run the
same phase workload, and the table, JSON and plot come out."""

from __future__ import annotations

import json

from loadgen.bench.client_cost import main as client_cost
from model_runner.bench.bench_cli import main as bench
from model_runner.bench.serving_arms import Arm, SlotPlanner


def test_tiny_matched_budget(tmp_path):
    out = tmp_path / "mb"
    code = bench(["matched-budget", "--dense-slots", "8", "--wmax", "128", "--boundary-wmax",
                  "128", "--placements", "hybrid", "--policies", "nr", "--seeds", "42",
                  "--num-prompts", "12", "--prompt-len", "24", "--dense-replays", "2",
                  "--checkpoint-interval", "0", "--no-cache-finished", "--concurrency", "6",
                  "--out", str(out), "--no-progress", "--save-requests"])
    assert code == 0
    result = json.loads((out / "matched-budget.json").read_text())
    dense, dasc = result["arms"]
    planner = SlotPlanner(dense_slots=8, model=result["config"]["model"], tp_size=1)
    assert dense["slots"] == planner.slots(Arm(0)) == 7  # floor(8 dense slots) - 1
    assert dasc["slots"] == planner.slots(Arm(128, "hybrid")) > dense["slots"]
    assert dasc["capacity_ratio"] > 1.5
    # dense 1 block of ceil(7 / 0.85) = 9 prompts x 2 replays; W128 and full: all 12 prompts
    assert [(p["block_len"], p["num_blocks"], p["num_replays"]) for p in result["phases"]] == [
        (9, 1, 2), (12, 1, 1), (12, 1, 1)]
    for arm in (dense, dasc):
        m = arm["seeds"]["42"]
        assert (m["completed"], m["failed"]) == (9 * 2 + 12 + 12, 0)
        assert m["server"]["cached_tokens"] == m["total_cached_tokens"]
        assert m["server"]["prompt_tokens"] == m["total_input_tokens"] == m["completed"] * 24
    assert dense["seeds"]["42"]["ttft_ratio"] == 1.0
    # every prompt fits the dasc arm's slots: each replay hits at len - 1
    assert dasc["seeds"]["42"]["cache_hit_rate"] == 23 / 24
    assert dense["seeds"]["42"]["cache_hit_rate"] < 23 / 24
    md = (out / "matched-budget.md").read_text()
    assert "| dense | 7 |" in md and "dasc-nr W=128 hybrid" in md and "TTFT / dense" in md
    assert (out / "matched-budget.png").stat().st_size > 10_000
    assert len((out / "requests" / "dense.jsonl").read_text().splitlines()) == 42


def test_client_cost_runs_both_clients_against_a_real_server(tmp_path):
    """Each client's requests all reach the server (its TTFT histogram counts them) and come
    back with a TTFT no shorter than the server's own; the server's CPU is split by role (each
    role's figure counts 10 ms clock ticks, too coarse for 12 requests one by one)."""
    out = tmp_path / "cc.json"
    assert client_cost(["--prompts", "4", "--prompt-len", "16", "--requests", "12",
                        "--concurrency", "4", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["client"] for r in rows] == ["aiohttp", "httpx"]
    for r in rows:
        assert r["requests"] == 12 and r["client_cpu_ms_per_request"] > 0
        assert r["client_mean_ttft_ms"] >= r["server_mean_ttft_ms"] > 0
        cpu = r["server_cpu_ms_per_request"]
        assert {"front end", "scheduler", "ranks"} <= set(cpu) and "other" not in cpu
        assert all(t >= 0 for t in cpu.values()) and sum(cpu.values()) > 0, cpu


def test_chat_parking_adopts_every_later_turn_only_when_parking(tmp_path):
    """Slots to spare: with parking every later turn adopts its parked slot (no load); with
    --no-park-finished every one loads a checkpoint (and wr replays the window)."""
    from loadgen.bench.chat_parking import main as chat_parking

    out = tmp_path / "chat.json"
    assert chat_parking(["--max-running-requests", "8", "--conversations", "2", "--turns", "3",
                         "--context", "40", "--turn-len", "8", "--max-tokens", "3",
                         "--concurrency", "2", "--out", str(out)]) == 0
    rows = {r["arm"]: r for r in json.loads(out.read_text())}
    later_turns = 2 * 2
    for arm in ("nr, not parked", "wr, not parked"):
        r = rows[arm]
        assert r["parked_hits"] == 0 and r["loads_nr"] + r["loads_wr"] == later_turns
    parked = rows["wr, parked (default)"]
    assert parked["parked_hits"] == later_turns and parked["loads_wr"] == 0
    assert parked["refresh_tokens"] == 0 < rows["wr, not parked"]["refresh_tokens"]
    assert all(r["failed"] == 0 for r in rows.values())
