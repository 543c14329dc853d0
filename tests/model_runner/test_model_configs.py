"""config.json parsing for the families beyond the built-in two, without weights: Qwen3.5 as
shipped (the language model's fields under text_config, the top level's tie), MoE configs with
no dense MLP size, OLMo-Hybrid's defaults (transformers' rotary, negative eigenvalues), errors
that name the field as the file holds it, the loader's one line for what it skips, and the
dtype ``--dtype auto`` picks."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from support.random_checkpoints import _rewrite, make_model
from support.runner_scenarios import make_runner
from support.serving import KIMI

from model_runner.config import ConfigError, ModelConfig
from model_runner.cpu_features import cpu_has_native_bf16
from model_runner.model_files import check_tp, resolve_dtype

TEXT = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 12,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "eos_token_id": 7,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [1, 1, 0]}}


def shipped(arch: str = "Qwen3_5ForConditionalGeneration", **text) -> dict:
    return {"architectures": [arch], "tie_word_embeddings": True,
            "text_config": {**TEXT, **text}, "vision_config": {"depth": 2}}


def test_qwen3_5_as_shipped_reads_its_text_config():
    cfg = ModelConfig.from_dict(shipped())
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.gva_ratio, cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor) == (
        3, 16, 1e7, 0.25)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 7  # the top level's tie wins
    assert cfg.mlp_types == ("dense",) * 4


def test_qwen3_5_moe_needs_no_dense_mlp_size():
    moe = shipped("Qwen3_5MoeForConditionalGeneration", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    del moe["text_config"]["intermediate_size"]
    cfg = ModelConfig.from_dict(moe)
    assert cfg.mlp_types == ("sparse",) * 4 and cfg.intermediate_size == 0
    dense = shipped()
    del dense["text_config"]["intermediate_size"]
    with pytest.raises(ConfigError, match="'intermediate_size' must be positive"):
        ModelConfig.from_dict(dense)


def test_a_shipped_config_without_text_config_is_refused():
    with pytest.raises(ConfigError, match="needs a 'text_config' object"):
        ModelConfig.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"], **TEXT})


def test_olmo_hybrid_defaults_follow_transformers():
    base = {"architectures": ["OlmoHybridForCausalLM"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    cfg = ModelConfig.from_dict(base)
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            cfg.num_key_value_heads) == (4, 12, 24, 4)
    assert cfg.linear_beta_scale == 2.0 and cfg.use_rope and cfg.partial_rotary_factor == 1.0
    no_neg = ModelConfig.from_dict({**base, "linear_allow_neg_eigval": False})
    assert no_neg.linear_beta_scale == 1.0
    nope = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": None}})
    assert not nope.use_rope


@pytest.mark.parametrize("config,tp,field", [
    (shipped(), 3, "text_config.linear_num_key_heads"),
    (shipped(num_key_value_heads=3, num_attention_heads=12), 4,
     "text_config.num_key_value_heads"),
    ({"architectures": ["KimiLinearForCausalLM"], "vocab_size": 96, "hidden_size": 64,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "first_k_dense_replace": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
      "qk_rope_head_dim": 8, "v_head_dim": 8,
      "linear_attn_config": {"num_heads": 6, "head_dim": 8, "full_attn_layers": [2],
                             "kda_layers": [1]}}, 4, "linear_attn_config.num_heads"),
])
def test_tp_errors_name_the_field_as_the_file_holds_it(config, tp, field):
    with pytest.raises(ConfigError, match=f"field '{field}'="):
        check_tp(ModelConfig.from_dict(config), tp)


def test_unused_tensors_are_skipped_with_one_line(tmp_path, capfd):
    make_model("qwen3_5_vl", tmp_path)
    embed = "model.language_model.embed_tokens.weight"
    _rewrite(tmp_path, lambda t: {**t, **{f"mtp.layers.0.{n}.weight": t[embed].clone()
                                          for n in ("fc", "proj")}})
    capfd.readouterr()
    make_runner(str(tmp_path))
    err = capfd.readouterr().err.strip().splitlines()
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        visual = sum(name.startswith("model.visual.") for name in f.keys())
    assert len(err) == 1 and "not loaded, unused for serving" in err[0]
    assert f"model.visual.* ({visual})" in err[0] and "mtp.* (2)" in err[0]


@pytest.mark.parametrize("config,device,native,expected", [
    ({"dtype": "bfloat16"}, "cpu", True, "bfloat16"),
    ({"dtype": "bfloat16"}, "cpu", False, "float32"),  # emulated bf16: fp32 is faster
    ({"torch_dtype": "bfloat16"}, "cuda", False, "bfloat16"),
    ({"text_config": {"dtype": "bfloat16"}}, "cpu", True, "bfloat16"),  # Qwen3.5 as shipped
    ({"dtype": "float32"}, "cpu", True, "float32"),
    ({}, "cpu", True, "float32"),
])
def test_auto_dtype_follows_the_checkpoint_where_the_device_computes_it(
        tmp_path, config, device, native, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", tmp_path, device, native_bf16=native) == expected
    assert resolve_dtype("float32", tmp_path, device, native_bf16=native) == "float32"


def test_the_servers_default_dtype_is_the_resolved_one(tmp_path):
    from dasc_server.flags import parse_args, serve_config

    assert serve_config(parse_args([])).ranks.dtype == "float32"  # the built-in fp32 model
    model = tmp_path / "bf16"
    shutil.copytree(KIMI, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    got = serve_config(parse_args(["--model", str(model)])).ranks.dtype
    assert got == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert serve_config(parse_args(["--model", str(model), "--dtype", "float32"])
                        ).ranks.dtype == "float32"
