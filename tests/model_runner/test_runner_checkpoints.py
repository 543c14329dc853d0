"""Compressed checkpoints through the model runner, at TP=1 in-process and TP=2 over gloo.

Dense plan (W_max = 0) in FP32: a cache hit (store -> load into another slot) gives exactly the
logits of continuing from the live state, in every layout and placement (and those equal one
pass without a cache up to float summation order).  W_max > 0 (dasc-nr): retained units come
back bit-identical, omitted units are zero, conv state is whole.  INT8: within the scale bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.ckpt_worker import FORMATS, hit_logits, plans
from support.ckpt_worker import main as _unused  # noqa: F401  (the worker must import cleanly)
from support.paths import SUPPORT
from support.random_checkpoints import make_model
from support.runner_scenarios import assert_rel_close

from model_runner.compression.plan import PlanError
from model_runner.config import ModelConfig
from model_runner.parallel import TPGroup


def check(results: dict, model_dir: str, tp_size: int) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    for (plan, _layout, payload, _placement), r in results.items():
        assert r["conv_equal"]
        if plan == "dense" and payload == "fp32":
            assert torch.equal(r["after"], r["before"])
            assert torch.equal(r["hit"], r["direct"])
            assert_rel_close(r["hit"], r["no_cache"], rtol=1e-5)
            continue
        # unit view [L, U, D] of this rank's state (rank 0 here)
        d = cfg.unit_numel
        before, after = r["before"].reshape(cfg.num_linear_layers, -1, d), r["after"].reshape(
            cfg.num_linear_layers, -1, d)
        kept = after.abs().sum(-1) > 0
        if plan == "w32":
            assert (~kept).any(), "a W_max = 32 plan should omit some units of this model"
        if payload == "fp32":
            assert torch.equal(after[kept], before[kept])
        else:
            assert (after - before)[kept].abs().max() <= before.abs().max() / 127
        assert not torch.allclose(r["hit"], r["no_cache"]) or plan == "dense"


# Qwen3.5 as shipped (language model nested, fused MoE experts) and OLMo-Hybrid beside the
# built-in families: the decay parameters, plans and unit layout must follow each one's names
ARCHES = {"kda": {}, "gdn": {"linear_num_key_heads": 4, "linear_num_value_heads": 8},
          "qwen3_5_moe_vl": {"linear_num_key_heads": 4, "linear_num_value_heads": 8},
          "olmo_hybrid": {"linear_num_key_heads": 4, "linear_num_value_heads": 8}}


@pytest.fixture(scope="module", params=sorted(ARCHES))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    make_model(request.param, path, **ARCHES[request.param])
    (path / "arch").write_text(request.param)
    return str(path)


def test_checkpoint_roundtrip_tp1(model):
    prompt = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    results = {}
    for name, plan in plans(model).items():
        for fmt in FORMATS:
            if fmt.placement == "off":
                results[name, fmt.layout, fmt.payload, fmt.placement] = hit_logits(
                    model, TPGroup(), plan, fmt, prompt, cut=17)
    check(results, model, 1)


def test_checkpoint_roundtrip_tp2(model, tmp_path, torchrun):
    torchrun(2, SUPPORT / "ckpt_worker.py", model, str(tmp_path))
    results = torch.load(tmp_path / "ckpt.pt")
    assert len(results) == 2 * len(FORMATS)
    check(results, model, 2)


def test_plan_for_other_weights_is_rejected(model, tmp_path):
    other = tmp_path / "other"
    arch = (Path(model) / "arch").read_text()
    make_model(arch, other, seed=99, **ARCHES[arch])
    from model_runner.checkpoints.pool import CheckpointFormat

    plan = plans(str(other))["w32"]
    with pytest.raises(PlanError):
        hit_logits(model, TPGroup(), plan, CheckpointFormat(), [5, 6, 7, 8], cut=2)
