"""The cache tier's fingerprint names what changes the bits a step computes, so a tier written
under one setting is never read under another: the prefill attention's and the delta rule's
AMX forms (``--cpu-amx-attention``, ``--cpu-amx-delta-rule``, where the CPU has AMX) and the
rank's threads (``--cpu-threads``: oneDNN splits some GEMM sums by them).  Each fingerprint
comes from a real rank's start-up (``serve_rank.start``) on a small bf16 Qwen3.5 whose head
sizes the AMX forms take."""

from __future__ import annotations

import pytest
import torch
from support.random_checkpoints import make_served_model

from dasc_server.flags import parse_args, serve_config
from kernels import prefill_attention
from kernels.delta_rule import cpu_chunk
from model_runner.cpu_features import cpu_has_native_bf16
from model_runner.parallel import shutdown_tp_group
from model_runner.serve_rank import start


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    make_served_model("qwen3_5", path, seed=2, head_dim=64, linear_key_head_dim=32,
                      linear_value_head_dim=32)
    return path


def fingerprint(model, tier, *flags: str) -> str:
    config = serve_config(parse_args(["--model", str(model), "--dtype", "bfloat16",
                                      "--cache-tier-dir", str(tier), "--max-total-tokens", "512",
                                      *flags]))
    threads = torch.get_num_threads()
    try:
        runner, tp, info = start(config)
        shutdown_tp_group(tp)
    finally:  # start() sets them for the process, as a rank's
        cpu_chunk.set_amx(True)
        prefill_attention.set_amx(True)
        torch.set_num_threads(threads)
    return info.tier_fingerprint


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="a bf16 model's CPU forms need native bf16")
def test_the_fingerprint_changes_with_the_forms_and_threads_that_change_bits(model, tmp_path):
    tier = tmp_path / "tier"
    base = fingerprint(model, tier, "--cpu-threads", "1")
    assert fingerprint(model, tier, "--cpu-threads", "1") == base  # the same settings
    assert fingerprint(model, tier, "--cpu-threads", "2") != base
    amx = cpu_chunk.amx_runs(32, 32) and prefill_attention.amx_runs(64)
    if not amx:
        pytest.skip("no AMX here: the forms do not change")
    assert fingerprint(model, tier, "--cpu-threads", "1", "--cpu-amx-attention", "off") != base
    assert fingerprint(model, tier, "--cpu-threads", "1", "--cpu-amx-delta-rule", "off") != base
