"""The tiny-model training script: its batches, its attention-pointer targets, a real short run.

The script and its ``tiny_models`` module live in ``scripts/``; importing them patches
transformers' chunk functions process-wide, so they run in a subprocess with ``scripts/`` as its
working directory and the transformers references of the other tests stay untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.paths import ROOT

from model_runner.config import ModelConfig

SCRIPTS = ROOT / "scripts"

BATCH_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import train_batches as t

report = []
weights = {"copy": 1, "s1": 1, "s3": 1, "mk2": 1, "mk3": 1, "mq": 1, "mv": 1, "cwe": 1}
for step in range(8):
    ids, answer, valid, is_copy, pointers, _ = t.make_batch(step, 1024, 0, 4, {192: 1.0},
                                                            weights)
    rows = {}
    for b, pos, src in pointers.tolist():
        rows.setdefault(b, []).append((pos, src))
    for b in range(ids.shape[0]):
        pairs = rows.get(b, [])
        report.append({
            "copy": bool(is_copy[b]),
            "answer_tokens": int(answer[b].sum()),
            "answer_chars": int((answer[b] & (ids[b] != 32) & (ids[b] != 10)).sum()),
            "pointers": len(pairs),
            "match": all(int(ids[b, p + 1]) == int(ids[b, s]) for p, s in pairs),
            "causal": all(s <= p for p, s in pairs),
            "in_answer": all(bool(answer[b, p + 1]) for p, _ in pairs),
        })
print(json.dumps(report))
"""


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def test_pointer_targets_copy_the_answer_characters():
    proc = subprocess.run([sys.executable, "-c", BATCH_CHECK, str(SCRIPTS)], cwd=SCRIPTS,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any(r["copy"] for r in rows) and any(not r["copy"] for r in rows)
    for r in rows:
        # every pointer names an earlier position holding exactly the token to be predicted
        assert r["match"] and r["causal"] and r["in_answer"], r
    copy_rows = [r for r in rows if r["copy"]]
    # a copy row points at every repeated character (the final newline has no source)
    assert all(r["pointers"] == r["answer_tokens"] - 1 for r in copy_rows)
    # needle rows (single, multi-key, multi-query, multi-value) point at every answer
    # character (not at spaces and newlines); other tasks (cwe) point nowhere
    needle_rows = [r for r in rows if not r["copy"] and r["pointers"]]
    assert len(needle_rows) >= 4
    assert all(r["pointers"] == r["answer_chars"] for r in needle_rows), needle_rows
    assert any(r["pointers"] == 0 for r in rows if not r["copy"])


def test_short_training_run_with_pointer_loss_and_state_reset_exports_a_loadable_model(tmp_path):
    cmd = [sys.executable, "train_tiny.py", "--model", "qwen3-next-tiny", "--out", str(tmp_path),
           "--max-steps", "2", "--minutes", "10", "--tokens-per-step", "384",
           "--length-weights", "192:1", "--task-weights", "copy:1,mk2:1",
           "--extra-questions", "2", "--pointer-weight", "1", "--state-reset", "1",
           "--log-every", "1", "--eval-n", "0"]
    proc = subprocess.run(cmd, cwd=SCRIPTS, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "qwen3-next-tiny" / "train.log").read_text()
    losses = [float(line.split("ptr_loss=")[1].split()[0]) for line in log.splitlines()
              if "ptr_loss=" in line]
    assert len(losses) == 2 and all(x > 0 for x in losses)
    final = tmp_path / "qwen3-next-tiny" / "final"
    # the eager attention the pointer loss needs is a training setting, not part of the model
    assert "eager" not in (final / "config.json").read_text()
    assert ModelConfig.from_dir(final).num_hidden_layers == 6


RESET_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import tiny_models as tm
import train_batches as t

gen = torch.Generator().manual_seed(0)
B, T, H, K, cut = 2, 70, 2, 8, 37
report = {}
for name, fn, g_shape in [("kda", tm.fast_kda_chunk, (B, T, H, K)),
                          ("gdn", tm.fast_gdn_chunk, (B, T, H))]:
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(*g_shape, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen)
    args = dict(use_qk_l2norm_in_kernel=True)
    full, _ = fn(q, k, v, g, beta, **args)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, cut] = True
    tm.set_state_reset(mask)
    reset, _ = fn(q, k, v, g, beta, **args)
    tm.set_state_reset(None)
    fresh, _ = fn(*(x[:1, cut:] for x in (q, k, v, g, beta)), **args)
    report[name] = {
        "before": (reset[0, :cut] - full[0, :cut]).abs().max().item(),
        "after_vs_fresh": (reset[0, cut:] - fresh[0]).abs().max().item(),
        "after_vs_full": (reset[0, cut:] - full[0, cut:]).abs().max().item(),
        "other_row": (reset[1] - full[1]).abs().max().item(),
    }

needles = {"copy": 1, "s1": 1, "mk2": 1, "mq": 1}
for label, weights, frac in [("needles", needles, 1.0), ("cwe", {"cwe": 1}, 1.0),
                             ("off", needles, 0.0)]:
    rows = []
    for step in range(4):
        ids, answer, valid, is_copy, pointers, resets = t.make_batch(
            step, 1024, 0, 2, {192: 1.0}, weights, frac)
        for b in range(ids.shape[0]):
            first_answer = int(answer[b].nonzero()[0])
            start = max(int(resets[b]), 0)
            rows.append({"copy": bool(is_copy[b]), "reset": int(resets[b]),
                         "first_answer": first_answer,
                         "question": bytes(ids[b, start:first_answer].tolist()).decode()})
    report[label] = rows
print(json.dumps(report))
"""


def test_state_reset_drops_the_linear_state_at_the_question():
    proc = subprocess.run([sys.executable, "-c", RESET_CHECK, str(SCRIPTS)], cwd=SCRIPTS,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("kda", "gdn"):
        r = report[kind]
        # before the reset and in other rows nothing changes; after it, the layer computes
        # exactly what it computes from a zero state on the rest of the sequence
        assert r["before"] < 1e-6 and r["other_row"] < 1e-6, r
        assert r["after_vs_fresh"] < 1e-4, r
        assert r["after_vs_full"] > 1e-2, r  # the dropped state mattered
    needle_rows = [r for r in report["needles"] if not r["copy"]]
    assert needle_rows and all(0 < r["reset"] < r["first_answer"] for r in needle_rows)
    # the reset falls where the question starts: what lies between it and the answer is
    # the question alone
    for r in needle_rows:
        assert "value" in r["question"] and len(r["question"]) < 120, r["question"]
    assert all(r["reset"] == -1 for r in report["needles"] if r["copy"])
    assert all(r["reset"] == -1 for r in report["cwe"] + report["off"])
