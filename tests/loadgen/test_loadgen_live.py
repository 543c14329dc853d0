"""dasc-loadgen against a real dasc-serve (default model, TP=1, checkpoints every 32 tokens):
what it reports must equal the server's own books (``/metrics``, ``/v1/stats``), a warm-up line
must stay out of the summary, and a refused request must be counted and shown."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serving import running_server

from loadgen.cli import main as loadgen

INTERVAL = 32


@pytest.fixture(scope="module")
def server():
    with running_server("--checkpoint-interval", str(INTERVAL)) as s:
        yield s


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {"finished": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dasc_finished_requests_total":
                out["finished"] += sample.value
            elif sample.name in ("dasc_prompt_tokens_total", "dasc_cached_tokens_total"):
                out[sample.name] = sample.value
    return out


def run_loadgen(server, tmp_path, capsys, *flags: str) -> tuple[list[dict], dict, str]:
    server.flush()
    out = tmp_path / "run.jsonl"
    code = loadgen(["--base-url", server.base_url, "--output", str(out), "--no-progress",
                    "--timeout", "120", *flags])
    table = capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and "summary" in lines[-1]
    return lines[:-1], lines[-1]["summary"], table


def test_shared_prefix_matches_server_metrics(server, tmp_path, capsys):
    before = scrape(server.base_url)
    lines, s, table = run_loadgen(
        server, tmp_path, capsys, "--workload", "shared-prefix", "--num-groups", "3",
        "--prompts-per-group", "4", "--prefix-len", "64", "--suffix-len", "8",
        "--concurrency", "4", "--seed", "3")
    after = scrape(server.base_url)
    assert (s["completed"], s["failed"], len(lines)) == (12, 0, 12)
    assert after["finished"] - before["finished"] == 12
    assert (after["dasc_prompt_tokens_total"] - before["dasc_prompt_tokens_total"]
            == s["total_input_tokens"] == 12 * 72)
    assert (after["dasc_cached_tokens_total"] - before["dasc_cached_tokens_total"]
            == s["total_cached_tokens"])
    for line in lines:  # warm requests hit the shared prefix's checkpoint at 64
        assert line["cached_tokens"] == (0 if line["cold"] else 64), line
        assert line["ttfb_ms"] <= line["ttft_ms"] <= line["e2el_ms"]
    assert s["cache_hit_rate"] == pytest.approx(9 * 64 / (12 * 72))
    assert s["cold_completed"] == 3 and s["warm_completed"] == 9
    assert "Mean TTFT (ms):" in table and "TTFT of warm requests (9)" in table


def test_file_workload_warmup_and_errors(server, tmp_path, capsys):
    context = [ord(c) for c in "the quick brown fox jumps over the lazy dog " * 2][:40]
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": context, "warmup": True},
            {"prompt": context + [65, 66, 67]},  # hits the warm-up, cached when it finished
            {"prompt": context},  # an exact repeat hits at len - 1
            {"prompt": [300, 1, 2]},  # outside the 264-token vocabulary: refused
            {"prompt": "hello there", "max_tokens": 3}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = scrape(server.base_url)
    lines, s, table = run_loadgen(server, tmp_path, capsys, "--workload", "file",
                                  "--prompt-file", str(prompts), "--concurrency", "2")
    after = scrape(server.base_url)
    warm = [line for line in lines if line.get("warmup")]
    timed = [line for line in lines if not line.get("warmup")]
    assert len(warm) == 1 and warm[0]["error"] is None and len(timed) == 4
    assert (s["completed"], s["failed"], s["num_warmup"]) == (3, 1, 1)
    assert after["finished"] - before["finished"] == 4  # warm-up + 3 completed
    assert [line["cached_tokens"] for line in timed] == [40, 39, None, 0]
    assert timed[2]["error"].startswith("HTTP 400") and "vocab" in timed[2]["error"].lower()
    assert timed[3]["output_tokens"] == 3 and len(timed[3]["itl_ms"]) >= 1
    assert s["total_input_tokens"] == 43 + 40 + timed[3]["prompt_tokens"]
    assert list(s["errors"].values()) == [1]
    assert "Failed requests:" in table and timed[2]["error"] in table


def test_phases_replay_counts_match_server_stats(server, tmp_path, capsys):
    lines, s, _ = run_loadgen(server, tmp_path, capsys, "--workload", "phases",
                              "--num-prompts", "10", "--prompt-len", "24",
                              "--boundary-slots", "4", "--dense-replays", "2",
                              "--concurrency", "4", "--seed", "42")
    requests = [line for line in lines if "telemetry" not in line]
    telemetry = [line["telemetry"] for line in lines if "telemetry" in line]
    # dense: Q = ceil(4 / 0.85) = 5, 2 blocks x 2 replays; full: one block of 10, 1 replay
    assert s["completed"] == len(requests) == 2 * 5 * 2 + 10 and s["failed"] == 0
    assert [(p["block_len"], p["num_blocks"]) for p in s["phases"]] == [(5, 2), (10, 1)]
    replays = [t for t in telemetry if t["step"] == "replay"]
    assert len(replays) == 5
    for t in replays:  # each timed window: the client's books = the server's
        mine = [r for r in requests if (r["phase"], r["block"], r["replay"])
                == (t["phase"], t["block"], t["replay"])]
        assert t["delta"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
        assert t["delta"]["cached_tokens"] == sum(r["cached_tokens"] for r in mine)
    assert s["duration"] == pytest.approx(sum(t["duration"] for t in replays))


def test_multi_turn_with_replies_resends_the_reply_and_adopts_the_parked_slot(server, tmp_path,
                                                                               capsys):
    """``--with-replies``: turn k sends turn k-1's prompt and reply before its new tokens, so
    it hits at everything turn k-1 processed (prompt + reply[:-1]): there the finished turn's
    parked slot is adopted (``parked_hits``), with no checkpoint load."""
    before = server.stats()["counters"]
    lines, s, _ = run_loadgen(
        server, tmp_path, capsys, "--workload", "multi-turn", "--with-replies",
        "--num-groups", "3", "--prompts-per-group", "3", "--prefix-len", "40",
        "--suffix-len", "6", "--max-tokens", "5", "--concurrency", "3", "--seed", "1")
    after = server.stats()["counters"]
    assert (s["completed"], s["failed"]) == (9, 0)
    by_turn = {(x["conversation"], x["turn"]): x for x in lines}
    for (c, t), x in by_turn.items():
        assert x["output_tokens"] == 5
        # context 40, +6 a turn, +5 reply tokens resent each later turn
        assert x["prompt_tokens"] == 40 + 6 * (t + 1) + 5 * t
        if t:
            prev = by_turn[(c, t - 1)]
            assert x["cached_tokens"] == prev["prompt_tokens"] + 5 - 1
    assert after["parked_hits"] - before["parked_hits"] == 6
    assert after["loads_nr"] == before["loads_nr"]
