"""Tensor parallelism over real torchrun + gloo: TP=2 and TP=4, each against transformers, for
every architecture
(prefill logits, 16 greedy decode steps, batched prefill, state round trip).  No 8-rank run:
8 ranks on 2 cores took 30 s of the suite and TP=4 already gives one KDA head per rank.

At TP=2 and TP=4 the first model also runs with linear-attention head bundles permuted across
ranks (the load-time step of TP-balanced placement): its logits must equal the unpermuted run.
At TP=2 the MoE + MLA model also decodes on the fixed-shape (CUDA-graph) path, padded batches
included, with the collectives inside the step."""

from __future__ import annotations

import json
import re

import pytest
import torch
from support.paths import SUPPORT
from support.random_checkpoints import make_model
from support.runner_scenarios import STEPS, assert_rel_close, check_against_reference, prompts

# Qwen3.5 and OLMo-Hybrid: every architecture at both degrees, GVA ratios 1 to 3; OLMo's q/k
# norms span the heads of every rank
QWEN3_5_OLMO = [("qwen3_5", dict(linear_num_key_heads=4, linear_num_value_heads=4)),
                ("qwen3_5_vl", dict(linear_num_key_heads=4, linear_num_value_heads=12)),
                ("qwen3_5_moe", dict(linear_num_key_heads=4, linear_num_value_heads=8)),
                ("qwen3_5_moe_vl", dict(linear_num_key_heads=4, linear_num_value_heads=8)),
                ("olmo_hybrid", dict(linear_num_key_heads=4, linear_num_value_heads=8))]
JOBS = {
    2: [("gdn", dict(linear_num_key_heads=4, linear_num_value_heads=8)),  # GVA ratio 2
        ("kda", dict()),
        ("gdn", dict()),  # 2 key heads -> one bundle per rank
        ("kda", dict(q_lora_rank=24, first_k_dense_replace=2)),
        *QWEN3_5_OLMO],
    4: [("kda", dict()),
        ("gdn", dict(linear_num_key_heads=4, linear_num_value_heads=8)),
        *QWEN3_5_OLMO],
}


@pytest.mark.parametrize("tp", sorted(JOBS))
def test_tp_matches_transformers(tp, tmp_path, torchrun):
    jobs, refs = [], []
    for i, (arch, overrides) in enumerate(JOBS[tp]):
        model_dir = tmp_path / f"m{i}"
        hf = make_model(arch, model_dir, seed=10 * tp + i, **overrides)
        ps = prompts(hf.config.get_text_config().vocab_size, seed=i)
        refs.append((hf, ps))
        jobs.append({"model_dir": str(model_dir), "prompts": ps, "steps": STEPS})
    if tp in (2, 4):  # job 0 again, bundles permuted differently in every linear layer
        types = refs[0][0].config.get_text_config().layer_types
        num_linear = sum(t == "linear_attention" for t in types)
        gen = torch.Generator().manual_seed(tp)
        order = [torch.randperm(4, generator=gen).tolist() for _ in range(num_linear)]
        jobs.append(dict(jobs[0], head_order=order))
    if tp == 2:  # job 1 again on the fixed-shape decode path (3 prompts pad to 4)
        jobs.append(dict(jobs[1], cuda_graph_max_bs=4))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    torchrun(tp, SUPPORT / "tp_worker.py", str(spec), str(tmp_path))
    for i, (hf, ps) in enumerate(refs):
        res = torch.load(tmp_path / f"job{i}.pt")
        check_against_reference(hf, ps, STEPS, res)
    if tp == 2:
        static = torch.load(tmp_path / f"job{len(jobs) - 1}.pt")
        check_against_reference(*refs[1], STEPS, static)
        plain = torch.load(tmp_path / "job1.pt")
        assert [t.tolist() for t in static["tokens"]] == [t.tolist() for t in plain["tokens"]]
        assert torch.equal(static["batch_tokens"], plain["batch_tokens"])
    if tp in (2, 4):
        plain = torch.load(tmp_path / "job0.pt")
        permuted = torch.load(tmp_path / f"job{len(refs)}.pt")
        assert [t.tolist() for t in permuted["tokens"]] == [t.tolist() for t in plain["tokens"]]
        for key in ("prefill", "decode_logits"):
            for a, b in zip(permuted[key], plain[key]):
                assert_rel_close(a, b, rtol=1e-5)
        assert_rel_close(permuted["roundtrip"], plain["roundtrip"], rtol=1e-5)


@pytest.mark.parametrize("nproc", [2, 4])
def test_shared_memory_collectives_match_gloo(torchrun, nproc):
    """CPU ranks on one host all-reduce and all-gather small tensors through shared memory: the
    rank-order sum bit for bit (equal to gloo's within rounding), gloo itself above a slot,
    buffers reused safely, non-contiguous inputs handled."""
    out = torchrun(nproc, SUPPORT / "shm_worker.py").stdout
    assert sorted(re.findall(r"rank \d+: ok, (?:no )?shm", out)) == [
        f"rank {r}: ok, shm" for r in range(nproc)], out


def test_a_shared_memory_collective_fails_fast_when_a_peer_exits(torchrun):
    """A rank killed mid-step: the others' collective raises within seconds (torch elastic
    would otherwise stop them only after its 30 s SIGTERM grace, which the ranks ignore)."""
    out = torchrun(2, SUPPORT / "shm_worker.py", "--peer-exits").stdout
    seen = re.findall(r"rank 0: peer exit seen in ([\d.]+) s", out)
    assert len(seen) == 1 and float(seen[0]) < 10, out
