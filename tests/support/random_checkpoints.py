"""Tiny random checkpoints of every supported architecture, written by transformers itself
(then, where transformers' own file differs from what the model's publisher ships, rewritten
into the published layout: Qwen3.5 MoE's fused experts, OLMo-Hybrid's per-part convs).

The reference classes are transformers' own (pure-torch path: fla must be blocked before they
are imported, its kernels need a GPU).  Decay parameters get a realistic spread (fla's init:
A_log = log U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)) and norm weights are
perturbed so that no parameter is trivially 0 or 1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)  # transformers' pure-torch path on CPU

import torch  # noqa: E402

from support.paths import ROOT  # noqa: E402


def _spread_decay(module_a_log: torch.Tensor, module_dt_bias: torch.Tensor, gen) -> None:
    a = torch.empty(module_a_log.shape).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(module_dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1),
                                                    generator=gen).exp()
    module_a_log.data.copy_(a)
    module_dt_bias.data.copy_(dt + torch.log(-torch.expm1(-dt)))


def _perturb(model, gen, std: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.dim() == 1 or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


# the tiny GDN models' shared geometry: 4 layers of width 64, 2 key / 4 value heads of 16
TINY_GDN = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                rms_norm_eps=1e-6)
PARTIAL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


def qwen3_next_config(**overrides) -> dict:
    cfg = dict(TINY_GDN, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               num_experts=4, num_experts_per_tok=2, rope_parameters=PARTIAL_ROTARY)
    cfg.update(overrides)
    return cfg


def kimi_linear_config(**overrides) -> dict:
    num_layers = overrides.pop("num_hidden_layers", 4)
    full = overrides.pop("full_attn_layers", [2, 4])
    lin = dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, full_attn_layers=full,
               kda_layers=[i for i in range(1, num_layers + 1) if i not in full])
    lin.update(overrides.pop("linear_attn_config", {}))
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
               num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
               kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               q_lora_rank=None, num_local_experts=4, num_experts_per_tok=2, n_group=1,
               topk_group=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, rms_norm_eps=1e-5, linear_attn_config=lin)
    cfg.update(overrides)
    return cfg


def qwen3_5_config(**overrides) -> dict:
    """Qwen3.5's text config (dense unless num_experts is given); layer 3 is full attention."""
    cfg = dict(TINY_GDN, tie_word_embeddings=True, rope_parameters={
        **PARTIAL_ROTARY, "mrope_interleaved": True, "mrope_section": [1, 1, 0]})
    cfg.update(overrides)
    return cfg


def olmo_hybrid_config(**overrides) -> dict:
    cfg = {k: v for k, v in TINY_GDN.items() if k != "head_dim"}  # 64 / 4 heads = 16
    cfg.update(num_key_value_heads=4, linear_value_head_dim=24, pad_token_id=0, eos_token_id=2)
    cfg.update(overrides)
    return cfg


# make_model's architectures beyond "gdn" (Qwen3-Next) and "kda" (Kimi-Linear)
QWEN3_5 = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl")


def _qwen3_5_model(arch: str, overrides: dict):
    import transformers as tf

    moe = "moe" in arch
    if moe:
        overrides = dict(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32), **overrides)
    text = qwen3_5_config(**overrides)
    if arch.endswith("_vl"):  # as Qwen ships it: a vision tower beside the language model
        config_cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        model_cls = tf.Qwen3_5MoeForConditionalGeneration if moe else \
            tf.Qwen3_5ForConditionalGeneration
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                      out_hidden_size=text["hidden_size"])
        return model_cls(config_cls(text_config=text, vision_config=vision,
                                    tie_word_embeddings=text["tie_word_embeddings"]))
    if moe:
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
    return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))


def _rewrite(out_dir: Path, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to every safetensors file of a saved model (and its
    index, if any)."""
    import json

    from safetensors.torch import load_file, save_file

    index = out_dir / "model.safetensors.index.json"
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = edit(load_file(str(path)))
        save_file(tensors, str(path), metadata={"format": "pt"})
        if index.is_file():
            raw = json.loads(index.read_text())
            raw["weight_map"] = {k: v for k, v in raw["weight_map"].items() if v != path.name}
            raw["weight_map"].update({k: path.name for k in tensors})
            index.write_text(json.dumps(raw))


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert MoE tensors -> Qwen3.5's published [E, 2I, H] gate_up_proj / [E, H, I]."""
    import re

    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {})[int(m[2]), m[3]] = t
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(num)]).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(num)])
    return out


def _olmo_convs(config):
    """transformers 5.24 saves OLMo-Hybrid's three convs as thirds of the fused one; the
    published files hold q (Hk*Dk), k (Hk*Dk) and v (Hv*Dv) channels."""
    key = config.linear_num_key_heads * config.linear_key_head_dim

    def edit(tensors: dict) -> dict:
        out = {k: v for k, v in tensors.items() if "_conv1d." not in k}
        for name in tensors:
            if name.endswith(".q_conv1d.weight"):
                base = name[: -len("q_conv1d.weight")]
                fused = torch.cat([tensors[f"{base}{p}_conv1d.weight"] for p in "qkv"])
                for part, chunk in zip("qkv", fused.split([key, key, fused.shape[0] - 2 * key])):
                    out[f"{base}{part}_conv1d.weight"] = chunk.contiguous()
        return out

    return edit


def make_model(arch: str, out_dir: str | Path, seed: int = 0, std: float = 0.08, **overrides):
    """Create, perturb and save a tiny model; returns the transformers model (eval, fp32).
    ``arch``: "gdn" (Qwen3-Next), "kda" (Kimi-Linear), one of ``QWEN3_5`` or "olmo_hybrid"."""
    from transformers import (
        KimiLinearConfig,
        KimiLinearForCausalLM,
        OlmoHybridConfig,
        OlmoHybridForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    if arch == "kda":
        model = KimiLinearForCausalLM(KimiLinearConfig(**kimi_linear_config(**overrides)))
        attn = [layer.self_attn for layer in model.model.layers]
        decays = [(a.forget_gate.A_log, a.forget_gate.dt_bias) for a in attn
                  if hasattr(a, "forget_gate")]
    else:
        if arch in QWEN3_5:
            model = _qwen3_5_model(arch, overrides)
        elif arch == "olmo_hybrid":
            model = OlmoHybridForCausalLM(OlmoHybridConfig(**olmo_hybrid_config(**overrides)))
        else:
            model = Qwen3NextForCausalLM(Qwen3NextConfig(**qwen3_next_config(**overrides)))
        decays = [(m.A_log, m.dt_bias) for name, m in model.named_modules()
                  if name.endswith("linear_attn")]
    _perturb(model, gen, std)
    for a_log, dt_bias in decays:
        _spread_decay(a_log, dt_bias, gen)
    model.config._attn_implementation = "eager"
    model.eval()
    model.save_pretrained(str(out_dir))
    if "moe" in arch:
        _rewrite(out_dir, _fuse_experts)
    if arch == "olmo_hybrid":
        _rewrite(out_dir, _olmo_convs(model.config))
    return model


def make_served_model(arch: str, out_dir: str | Path, seed: int = 0, **overrides):
    """A tiny random model that dasc-serve can run: the built-in models' byte tokenizer (its
    files and its 259 ids, <pad> 256, <eos> 258) beside a ``make_model`` checkpoint."""
    import shutil

    assets = ROOT / "model_runner" / "assets" / "qwen3-next-tiny"
    out_dir = Path(out_dir)
    model = make_model(arch, out_dir, seed, vocab_size=259, pad_token_id=256, eos_token_id=258,
                       **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(assets / name, out_dir / name)
    return model
