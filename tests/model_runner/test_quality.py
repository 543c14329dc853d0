"""Quality study: paired statistics against known answers, logit fidelity, the
shared-prefill sweep (every arm, KV restore, the greedy shortcut, resume) and the report."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.paths import ROOT
from transformers import AutoTokenizer

from model_runner.quality.arms import Arm, expand_arms
from model_runner.quality.fidelity import greedy_reproduces, mean_kl, mean_nll, scored_logprobs
from model_runner.quality.paired_stats import holm, paired_bootstrap
from model_runner.quality.report import compare, paired_diffs, report, table5, targets
from model_runner.quality.results import appender, load_results
from model_runner.quality.sweep import InstanceScore, Result, sweep
from model_runner.quality.tables import Runs
from model_runner.runner import ModelRunner, RunnerConfig

KIMI = ROOT / "model_runner" / "assets" / "kimi-linear-tiny"


# ---- statistics with known answers ----------------------------------------------------------

def test_identical_arms_give_zero_difference_and_p_one():
    for diffs in (np.zeros(40), np.array([1.0, -1.0] * 10)):  # equal, and symmetric about 0
        s = paired_bootstrap(diffs)
        assert s.diff == 0 and s.p == 1.0 and s.ci_low <= 0 <= s.ci_high


def test_shifted_arm_gives_a_ci_excluding_zero():
    diffs = np.random.default_rng(3).normal(0.5, 0.3, 40)
    s = paired_bootstrap(diffs)
    assert 0 < s.ci_low < diffs.mean() < s.ci_high
    assert s.p_at_floor and s.p < 1e-3
    assert paired_bootstrap(-diffs).ci_high < 0


def test_centred_bootstrap_p_agrees_with_normal_theory():
    """A moderate shift: the centred-bootstrap p is close to the z-test's two-sided p."""
    diffs = np.random.default_rng(5).normal(0.0, 1.0, 400) + 0.09
    s = paired_bootstrap(diffs)
    z = abs(diffs.mean()) / (diffs.std(ddof=1) / math.sqrt(diffs.size))
    p_normal = math.erfc(z / math.sqrt(2))
    assert 0.01 < p_normal < 0.5 and abs(s.p - p_normal) < 0.02, (s.p, p_normal)
    ci_half = 1.96 * diffs.std(ddof=1) / math.sqrt(diffs.size)
    assert abs((s.ci_high - s.ci_low) / 2 - ci_half) < 0.1 * ci_half


def test_holm_on_a_known_vector():
    # sorted 0.005 0.01 0.03 0.04 -> 4*0.005, 3*0.01, 2*0.03, max(0.06, 1*0.04)
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(holm([0.5, 0.4, 0.3]), [0.9, 0.9, 0.9])  # 3 * 0.3 carries
    np.testing.assert_allclose(holm([0.9, 0.8]), [1.0, 1.0])  # clipped at 1
    out = holm([0.02, float("nan"), 0.01])
    assert math.isnan(out[1]) and np.allclose(out[[0, 2]], [0.02, 0.02])


# ---- logit fidelity -------------------------------------------------------------------------

def test_fidelity_measures():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    ref = scored_logprobs(logits)  # 2 scored positions
    assert mean_kl(ref, ref) == 0.0
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    kl = float((p * (p / q).log()).sum())
    two = torch.stack([p.log(), p.log()]).double(), torch.stack([q.log(), q.log()]).double()
    assert mean_kl(*two) == pytest.approx(kl)
    # suffix [x, 0, 1]: NLL of token 0 at position 0 and token 1 at position 1
    want = -(float(ref[0, 0]) + float(ref[1, 1])) / 2
    assert mean_nll(ref, [7, 0, 1]) == pytest.approx(want)
    # question of 1 token: logits[0:2] predict the completion [0, 1]
    assert greedy_reproduces(logits, 1, [0, 1]) and not greedy_reproduces(logits, 1, [0, 2])


def test_expand_arms():
    arms = expand_arms(["dense", "nr", "random", "wr@64.0", "nr@16"], [16, 64], [1, 2])
    assert [a.label for a in arms] == ["dense", "nr@16", "nr@64", "random@16/s1",
                                       "random@16/s2", "random@64/s1", "random@64/s2", "wr@64"]
    with pytest.raises(ValueError, match="needs --w-max"):
        expand_arms(["wr"], [], [1])


# ---- the sweep on the shipped model ---------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    rc = RunnerConfig(str(KIMI), num_pages=3 * 48, page_size=16, num_state_slots=7)
    torch.manual_seed(0)
    return ModelRunner(rc), AutoTokenizer.from_pretrained(KIMI)


def _sweep(shipped, arms, tasks=("s1", "mv"), **kw):
    runner, tokenizer = shipped
    return {(r.label, r.task): r for r in sweep(runner, "kimi", list(tasks), [512], 3, 0, arms,
                                                3, tokenizer, **kw)}


def test_greedy_shortcut_equals_decoding_and_arms_do_not_leak(shipped):
    """Skipping the decode where teacher forcing already reproduces the gold completion gives
    the decoded scores; an arm that zeroes the context KV leaves later arms untouched."""
    arms = [Arm("dense"), Arm("zero-full-kv"), Arm("nr@1024"), Arm("random@64", 3)]
    fast = _sweep(shipped, arms)
    slow = _sweep(shipped, arms, decode_all=True)
    assert fast.keys() == slow.keys()
    for key in fast:
        assert fast[key].instances == slow[key].instances, key
    assert fast[("dense", "s1")].accuracy == 1.0 and fast[("zero-full-kv", "s1")].accuracy == 0
    alone = _sweep(shipped, [Arm("nr@1024")])
    for task in ("s1", "mv"):
        assert alone[("nr@1024", task)].instances == fast[("nr@1024", task)].instances


def test_every_arm_quick_cli():
    cmd = [sys.executable, "-m", "model_runner.quality.eval_cli", "--quick", "--tasks", "s1",
           "--arms",
           "dense", "nr", "wr", "nr-int8", "random", "zero-full-kv", "zero-linear", "zero-both",
           "--w-max", "64", "--mask-seeds", "1", "2", "--threads", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["arm"], r.get("mask_seed")): r for r in map(json.loads, proc.stdout.splitlines())}
    assert list(rows) == [("dense", None), ("nr@64", None), ("wr@64", None),
                          ("nr-int8@64", None), ("random@64", 1), ("random@64", 2),
                          ("zero-full-kv", None), ("zero-linear", None), ("zero-both", None)]
    for r in rows.values():
        assert {"arm", "task", "length", "accuracy", "n", "kl", "delta_nll"} <= r.keys()
        assert r["n"] == 3 and len(r["instances"]["kl"]) == 3
    assert rows[("dense", None)]["kl"] == 0 and rows[("dense", None)]["delta_nll"] == 0
    nr, wr, int8 = (rows[(a, None)]["kl"] for a in ("nr@64", "wr@64", "nr-int8@64"))
    assert 0 < wr < nr and int8 > 0 and int8 != nr
    assert min(rows[("random@64", s)]["kl"] for s in (1, 2)) > nr  # decay-aware keeps more
    assert rows[("zero-full-kv", None)]["kl"] > 1.0 > rows[("zero-linear", None)]["kl"] > nr


def test_resumable_output(tmp_path, shipped):
    """An interrupted run (a unit missing, the last line cut short) continues where it
    stopped: finished units are skipped, the missing one is run, the cut line is ignored."""
    out = tmp_path / "r.jsonl"
    arms = [Arm("dense"), Arm("nr@64")]
    full = _sweep(shipped, arms, tasks=("s1",), emit=appender(out))
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    out.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    done = frozenset(r.key() for r in load_results(out))
    assert len(done) == 1
    again = _sweep(shipped, arms, tasks=("s1",), done=done, emit=appender(out))
    assert list(again) == [("nr@64", "s1")]
    assert again[("nr@64", "s1")].instances == full[("nr@64", "s1")].instances
    results = load_results(out)
    assert sorted(r.label for r in results) == ["dense", "nr@64"]
    assert _sweep(shipped, arms, tasks=("s1",), done={r.key() for r in results}) == {}


# ---- the report -----------------------------------------------------------------------------

def _runs(random_kl_shift: float, random_acc: float = 1.0) -> Runs:
    """Synthetic study: dense, nr@16 identical to dense in accuracy, two random masks."""
    def res(task, length, arm, kl, acc=1.0, seed=None):
        inst = [InstanceScore(i, acc, kl + 0.001 * i) for i in range(20)]
        return Result.of("m", Arm(arm, seed), task, length, 0, inst)

    out = []
    for cell in [("s1", 512), ("s1", 1024), ("cwe", 512), ("cwe", 1024)]:
        out += [res(*cell, "dense", 0.0), res(*cell, "nr@16", 0.01), res(*cell, "wr@512", 0.001),
                res(*cell, "nr@512", 0.1), res(*cell, "nr-int8@16", 0.011)]
        out += [res(*cell, "random@16", 0.01 + random_kl_shift, random_acc, s) for s in (1, 2)]
    return Runs(out)


def test_paired_report_known_answers():
    same = _runs(0.0)
    assert paired_diffs(same, "m", 16, "retrieval", "kl") == pytest.approx([0.0] * 40)
    rows = [line for line in table5(compare(same, "kl", 500, 0) + compare(same, "accuracy", 500,
                                                                          0), 500).splitlines()]
    assert all("+0.00" in r and "| 1.0000 | 1.0000 |" in r for r in rows[2:]), rows
    shifted = _runs(0.05, random_acc=0.5)
    kl = compare(shifted, "kl", 500, 0)
    assert all(c.stat.ci_high < 0 and c.p_holm < 0.05 for c in kl)
    acc = compare(shifted, "accuracy", 500, 0)
    assert all(c.stat.diff == pytest.approx(0.5) for c in acc)
    text = targets(shifted, kl)
    assert "every family aggregate: **holds**" in text
    assert "in every family at every W_max: **holds**" in text
    assert "W_max=512: wr closer to dense than nr: **holds**" in text
    assert "**holds**" not in targets(same, compare(same, "kl", 500, 0)).split("\n")[1]


def test_report_tables_have_the_paper_shapes():
    text = report(_runs(0.05), resamples=200)
    for head in ("## Targets", "## Summary per W_max", "## Table 2 shape", "## Table 4 shape",
                 "## Table 5 shape", "## Table 6 / 7 shape: full sweep, m"):
        assert head in text
    assert "| Model | Config | Len | S1 | CWE | Avg | KL | Δ NLL |" in text
    summary = "| m | 16 | 1.00 | 1.00 | – | 1.00 ± 0.00 | 1.00 | 0.0195 | – | 0.0695 ± 0.0000 |"
    assert summary in text


def test_study_quick_runs_every_arm_and_the_report(tmp_path):
    cmd = [sys.executable, "-m", "model_runner.quality.eval_cli", "study", "--quick", "--models",
           str(KIMI), "--out-dir", str(tmp_path), "--resamples", "200", "--tasks", "s1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "[dasc-eval] kimi-linear-tiny s1 512" in proc.stderr  # progress on stderr
    results = load_results(tmp_path / "kimi-linear-tiny.jsonl")
    assert sorted({r.label for r in results}) == sorted(
        ["dense"] + [f"{k}@{w}" for k in ("nr", "wr", "nr-int8") for w in (16, 1024)]
        + [f"random@{w}/s{s}" for w in (16, 1024) for s in (1234, 2027)])
    text = (tmp_path / "tables.md").read_text()
    assert "## Table 5 shape" in text and "kimi-linear-tiny | KL | retrieval | 1024 |" in text
    assert (tmp_path / "quality.png").stat().st_size > 10_000
