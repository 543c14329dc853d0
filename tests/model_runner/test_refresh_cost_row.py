"""`dasc-bench refresh-cost`'s per-W_max figures from each seed's metrics of the nr and wr arms:
the paper's latency cost per hit and the rank compute the refresh adds per hit."""

from __future__ import annotations

import pytest

from model_runner.bench.refresh import cost_row, markdown


def _metrics(ttft_ms: float, hits: int, compute_s: float, loads_wr: int = 0,
             refresh_tokens: int = 0) -> dict:
    return {"mean_ttft_ms": ttft_ms, "num_hits": hits, "completed": 120, "cache_hit_rate":
            hits / 120, "server": {"compute_s": compute_s, "loads_wr": loads_wr,
                                   "refresh_tokens": refresh_tokens, "parked_hits": 0}}


def test_cost_row_gives_latency_and_compute_per_hit():
    nr = {1: _metrics(700.0, 90, 6.00), 2: _metrics(650.0, 0, 5.00)}
    wr = {1: _metrics(730.0, 90, 6.18, loads_wr=90, refresh_tokens=1440),
          2: _metrics(660.0, 0, 5.10)}
    row = cost_row(16.0, nr, wr, [1, 2])
    assert row["delta_ttft_ms"] == [30.0, 10.0]
    assert row["cost_per_hit_ms"][0] == pytest.approx(30.0 * 120 / 90)
    assert row["compute_per_hit_ms"][0] == pytest.approx(2.0)  # 0.18 s over 90 hits
    assert row["cost_per_hit_ms"][1] is None and row["compute_per_hit_ms"][1] is None
    assert row["replay_tokens_per_hit"] == 16.0
    table = markdown({"rows": [row], "config": {
        "park_finished": "False", "checkpoint_slots": "256", "num_conversations": "24",
        "num_turns": "5", "context_len": "512", "turn_len": "64", "placement": "hybrid",
        "seeds": "[1, 2]"}})
    header, _, line = table.strip().splitlines()[-3:]
    cells = dict(zip(header.split(" | "), line.split(" | ")))
    assert cells["rank compute/hit (ms)"] == "2.0 ± 0.0"
