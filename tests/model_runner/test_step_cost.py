"""model_runner/bench/step_cost.py: the graph path reads only the routed experts at decode batch
sizes, and the all-experts figures are the expected ones (~94 GB Kimi-Linear, ~154 GB
Qwen3-Next at TP 1)."""

from __future__ import annotations

import pytest

from model_runner.bench import step_cost as sc
from model_runner.config import ModelConfig


@pytest.mark.parametrize("name,experts_gb", [("kimi-linear-48b-a3b-instruct", 94.2),
                                             ("qwen3-next-80b-a3b-instruct", 154.6)])
def test_graph_path_reads_only_routed_experts(name, experts_gb):
    cfg = ModelConfig.from_dir(sc.CONFIGS / name)
    k = cfg.num_experts_per_tok
    for tp in (1, 8):
        for batch in (1, 8):
            eager, before, graph = sc.decode_rows(cfg, tp, batch, 4096, 2)
            assert graph[0] == "graph (gathered)" and float(graph[2]) == batch * k
            assert float(before[2]) == cfg.num_experts
            assert float(graph[3]) < float(before[3]) / 3
            if batch == 1:  # the very experts the eager path reads
                assert graph[2:] == eager[2:]
    _, before, _ = sc.decode_rows(cfg, 1, 1, 4096, 2)
    assert float(before[4]) == pytest.approx(experts_gb, abs=0.1)
