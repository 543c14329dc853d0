"""dasc-eval: the quick run on the shipped model, and the Table 1(a) intervention wiring."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from support.paths import ROOT
from support.random_checkpoints import make_model
from support.runner_scenarios import make_runner

from model_runner.batch import SeqInput
from model_runner.quality import eval_cli
from model_runner.quality.arms import apply_arm, prepare_arm
from model_runner.quality.results import markdown_table
from model_runner.quality.sweep import Result
from model_runner.quality.tasks import TASKS


def test_quick_eval_on_shipped_model():
    proc = subprocess.run([sys.executable, "-m", "model_runner.quality.eval_cli", "--quick",
                           "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["task"] for r in rows] == list(TASKS)
    for r in rows:
        assert r["arm"] == "dense" and r["length"] == 512 and r["n"] == 3
        scores = r["instances"]["score"]
        assert len(scores) == 3 and abs(r["accuracy"] - sum(scores) / 3) < 1e-9
    # the shipped model solves single-needle retrieval at 512 (docs/results/table1.md)
    assert next(r for r in rows if r["task"] == "s1")["accuracy"] >= 2 / 3


@pytest.mark.parametrize("model", ["kimi-linear-tiny", "qwen3-next-tiny"])
def test_shipped_models_retrieve_through_full_attention(model):
    """Paper Table 1(a) on the shipped models: they solve single-needle retrieval from a cached
    prefix; without the prefix's full-attention KV retrieval fails, and without its linear
    state (recurrent and conv) S1 barely moves."""
    cmd = [sys.executable, "-m", "model_runner.quality.eval_cli", "--model",
           str(ROOT / "model_runner" / "assets" / model), "--tasks", "s1", "--lengths", "512",
           "--n", "8", "--arms", "dense", "zero-full-kv", "zero-linear", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    acc = {r["arm"]: r["accuracy"] for r in map(json.loads, proc.stdout.splitlines())}
    assert acc["dense"] >= 0.75, acc
    assert acc["zero-full-kv"] <= 0.25, acc
    assert acc["zero-linear"] >= acc["dense"] - 0.25, acc


def test_unknown_task_is_a_clear_error(capfd):
    # in-process: the check comes before any model loads, so a fresh Python is all a subprocess
    # would add
    assert eval_cli.main(["--tasks", "s9"]) == 2
    assert "unknown task 's9'" in capfd.readouterr().err


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "model"
    make_model("kda", path)
    return make_runner(str(path))


def _prefill(runner, context, question):
    seq = SeqInput(context, 0, list(range(10)), 1)
    runner.forward([seq])
    seq.prefix_len, seq.token_ids = len(context), question
    return seq


@pytest.mark.parametrize("kind", ["dense", "zero-full-kv", "zero-linear", "zero-both"])
def test_intervention_zeroes_exactly_what_it_says(runner, kind):
    context, question = list(range(3, 30)), [40, 41, 42]
    seq = _prefill(runner, context, question)
    kv_before = [c.clone() for c in runner.kv.caches]
    state_before = runner.read_state(1)
    apply_arm(runner, [seq], kind)
    prefix_rows = torch.tensor([p * 4 + o for p in range(10) for o in range(4)])[: len(context)]
    other_rows = torch.arange(runner.kv.caches[0].shape[0])
    other_rows = other_rows[~torch.isin(other_rows, prefix_rows)]
    for before, after in zip(kv_before, runner.kv.caches):
        assert torch.equal(after[other_rows], before[other_rows])
        if kind in ("zero-full-kv", "zero-both"):
            assert after[prefix_rows].abs().sum() == 0 and before[prefix_rows].abs().sum() > 0
        else:
            assert torch.equal(after[prefix_rows], before[prefix_rows])
    state = runner.read_state(1)
    if kind in ("zero-linear", "zero-both"):
        assert state.temporal.abs().sum() == 0 and state.conv.abs().sum() == 0
    else:
        assert torch.equal(state.temporal, state_before.temporal)
        assert torch.equal(state.conv, state_before.conv)


def test_each_cache_component_changes_the_answer_logits(runner):
    context, question = list(range(3, 30)), [40, 41, 42]
    logits = {}
    for kind in ("dense", "zero-full-kv", "zero-linear"):
        seq = _prefill(runner, context, question)
        apply_arm(runner, [seq], kind)
        logits[kind] = runner.forward([seq])
    assert not torch.allclose(logits["dense"], logits["zero-full-kv"])
    assert not torch.allclose(logits["dense"], logits["zero-linear"])


def test_markdown_table_shape():
    rows = [Result("dense", "s1", 512, 1.0, 3), Result("dense", "vt", 512, 0.5, 3)]
    table = markdown_table(rows, ["s1", "vt"]).splitlines()
    assert table[0] == "| Arm | Len | S1 | VT | Avg |"
    assert table[2] == "| dense | 512 | 1.00 | 0.50 | 0.75 |"


def test_compressed_arm_zero_fills_omitted_units(runner):
    """nr@W stores the prefix state through a dasc checkpoint and loads it back: retained units
    are exact, omitted ones zero, so the state changes exactly where the plan omits."""
    prepare_arm(runner, "nr@32", batch=2)
    seq = _prefill(runner, list(range(3, 30)), [40, 41])
    before = runner.read_state(1).temporal
    apply_arm(runner, [seq], "nr@32")
    after = runner.read_state(1).temporal
    d = runner.cfg.unit_numel
    b, a = before.reshape(before.shape[0], -1, d), after.reshape(after.shape[0], -1, d)
    kept = runner.checkpoints.plan.mask()  # [L, units] (TP=1: local = global units)
    assert torch.equal(a[kept], b[kept])
    assert (~kept).any() and a[~kept].abs().sum() == 0


def test_bad_arm_is_a_clear_error(capfd):
    assert eval_cli.main(["--arms", "nr@-3"]) == 2
    assert "unknown arm 'nr@-3'" in capfd.readouterr().err


def test_wr_arm_refreshes_omitted_units(runner):
    prepare_arm(runner, "wr@32", batch=2)
    context = list(range(3, 30))
    seq = _prefill(runner, context, [40, 41])
    dense = runner.read_state(1).temporal
    apply_arm(runner, [seq], "wr@32", [context])
    after = runner.read_state(1).temporal
    d = runner.cfg.unit_numel
    b, a = dense.reshape(dense.shape[0], -1, d), after.reshape(after.shape[0], -1, d)
    kept = runner.checkpoints.plan.mask()
    assert torch.equal(a[kept], b[kept])
    assert a[~kept].abs().sum() > 0  # refreshed, not zero-filled
