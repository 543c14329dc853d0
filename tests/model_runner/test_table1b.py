"""Table 1(b) wiring: captured gates, states and queries line up with the static horizons."""

from __future__ import annotations

import torch
from support.random_checkpoints import make_model

from model_runner.compression.horizons import static_horizons
from model_runner.compression.weights import load_decay_params
from model_runner.quality.table1b import observe, table1b
from model_runner.runner import ModelRunner, RunnerConfig


def test_observed_measures_track_static_horizons(tmp_path):
    make_model("kda", tmp_path, vocab_size=264)
    table = table1b(str(tmp_path), count=3, seed=0)
    # In a random model the gate input f is small next to dt_bias, so the observed decay must
    # rank units almost exactly as the weights do -- unless capture is wired to the wrong units.
    assert table["H_e"]["median"] > 0.9
    assert table["H_e"]["pairs"] == 3 * 2
    # A long-horizon unit keeps more of what it is fed, so its state norm tracks H_s too, and
    # the readout q.S, mixed by the query, less (measured: 0.75-0.78 and 0.41-0.43 over seeds);
    # the paper's order H_e > |S| > |o|.  Captures wired to the wrong units give rho ~ 0.
    medians = [table[m]["median"] for m in ("H_e", "state_norm", "readout_norm")]
    assert medians == sorted(medians, reverse=True) and medians[2] > 0.2, medians


def test_capture_shapes_gdn(tmp_path):
    make_model("gdn", tmp_path, vocab_size=264)
    runner = ModelRunner(RunnerConfig(str(tmp_path), num_pages=8, page_size=16,
                                      num_state_slots=2))
    obs = observe(runner, list(range(40, 90)))
    static = static_horizons(runner.cfg, load_decay_params(str(tmp_path), runner.cfg))
    for values in obs.values():
        assert values.shape == static.shape == (3, 4)  # 3 GDN layers x 4 value heads
        assert torch.isfinite(values).all()
