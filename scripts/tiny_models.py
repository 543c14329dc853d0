"""Tiny Kimi-Linear (KDA) and Qwen3-Next (GDN) models in the exact transformers formats.

Import this module before anything imports ``fla``: it blocks fla so that transformers binds its
pure-torch paths on CPU (fla's Triton kernels fail without a GPU), then routes the two chunked
delta-rule functions through dasc's vectorised ``chunk_delta_rule``.  The transformers forward
calls those functions through module globals (``use_kernelized_func`` is a no-op without the
``kernels`` hub package), so replacing the module attributes is enough; ``check_patch`` proves it.
"""

from __future__ import annotations

import math
import sys

sys.modules.setdefault("fla", None)  # must precede the transformers model imports

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import (  # noqa: E402
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.kimi_linear import modeling_kimi_linear as kimi_mod  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qwen_mod  # noqa: E402

from kernels.delta_rule.naive import chunk_delta_rule, l2norm_div, l2norm_rsqrt  # noqa: E402
from model_runner.byte_tokenizer import BOS_ID, EOS_ID, MODEL_VOCAB_SIZE, PAD_ID  # noqa: E402

MODEL_NAMES = ("kimi-linear-tiny", "qwen3-next-tiny")
NUM_LAYERS = 6
LAYER_TYPES = ["full_attention" if (i + 1) % 3 == 0 else "linear_attention"
               for i in range(NUM_LAYERS)]  # layers 2 and 5 are full attention
HORIZON_EPS = 1e-3
STATIC_GATE_INPUT = -0.3
RESET_LOG_DECAY = -30.0  # exp(-30) ~ 1e-13: the step that multiplies the state by ~0
_state_reset: torch.Tensor | None = None  # [B, T] bool, see ``set_state_reset``

ORIGINAL_KDA_CHUNK = kimi_mod.chunk_kimi_delta_attention
ORIGINAL_GDN_CHUNK = qwen_mod.torch_chunk_gated_delta_rule


def fast_kda_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Drop-in for transformers' ``chunk_kimi_delta_attention`` (same args, same outputs)."""
    q, k = query.float(), key.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_div(q), l2norm_div(k)
    o, state = chunk_delta_rule(q, k, value.float(), _with_resets(g), beta.float(), initial_state,
                                scale=k.shape[-1] ** -0.5)
    return o.to(query.dtype), state if output_final_state else None


def fast_gdn_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Drop-in for transformers' ``torch_chunk_gated_delta_rule`` (GVA expanded here)."""
    ratio = value.shape[2] // key.shape[2]
    q, k = query.float(), key.float()
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_rsqrt(q), l2norm_rsqrt(k)
    o, state = chunk_delta_rule(q, k, value.float(), _with_resets(g), beta.float(), initial_state,
                                scale=k.shape[-1] ** -0.5)
    return o.to(query.dtype), state if output_final_state else None


def set_state_reset(mask: torch.Tensor | None) -> None:
    """Training augmentation: where ``mask`` [B, T] is set, every linear layer's recurrent state
    is dropped just before that token (its decay step becomes ~0), as when a cached prefix's
    linear state is lost; the conv window and the attention KV are untouched.  None: off."""
    global _state_reset
    _state_reset = mask


def _with_resets(g: torch.Tensor) -> torch.Tensor:
    mask, g = _state_reset, g.float()
    if mask is None:
        return g
    if mask.shape != g.shape[:2]:
        raise ValueError(f"state-reset mask {tuple(mask.shape)} does not match {tuple(g.shape)}")
    drop = mask.to(g.dtype).reshape(*mask.shape, *(1,) * (g.dim() - 2)) * RESET_LOG_DECAY
    return g + drop


def set_fast_chunks(is_fast: bool) -> None:
    """Route (or un-route) the transformers chunk functions through ``chunk_delta_rule``."""
    kimi_mod.chunk_kimi_delta_attention = fast_kda_chunk if is_fast else ORIGINAL_KDA_CHUNK
    qwen_mod.torch_chunk_gated_delta_rule = fast_gdn_chunk if is_fast else ORIGINAL_GDN_CHUNK


def kimi_config() -> KimiLinearConfig:
    """KDA: 4 heads x 32 per linear layer (512 units in 4 layers); MLA with NoPE, 4 heads."""
    return KimiLinearConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=NUM_LAYERS, layer_types=list(LAYER_TYPES),
        mlp_layer_types=["dense"] * NUM_LAYERS, first_k_dense_replace=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        linear_attn_config={  # as in the real checkpoints; layer lists are 1-based
            "head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4,
            "kda_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
        },
        linear_head_dim=32, linear_num_heads=4, linear_conv_kernel_dim=4,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-5,
    )


def qwen_config() -> Qwen3NextConfig:
    """GDN: 4 key heads, 8 value heads (GVA 2) x 32; gated attention 4 q / 4 kv heads x 32."""
    return Qwen3NextConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=NUM_LAYERS, layer_types=list(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=0, mlp_only_layers=list(range(NUM_LAYERS)),
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        tie_word_embeddings=False, max_position_embeddings=8192,
    )


def decay_modules(model) -> list:
    """The modules holding ``A_log`` and ``dt_bias`` of every linear layer, in layer order."""
    kinds = (kimi_mod.KimiLinearForgetGate, qwen_mod.Qwen3NextGatedDeltaNet)
    return [m for m in model.modules() if isinstance(m, kinds)]


def init_decay(model, generator: torch.Generator) -> None:
    """A_log = log U(1, 16) per head; dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1), per
    value head (GDN) or per (head, key channel) (KDA): a wide spread of retention horizons."""
    with torch.no_grad():
        for m in decay_modules(model):
            a = torch.empty(m.A_log.shape).uniform_(1.0, 16.0, generator=generator)
            m.A_log.copy_(a.log())
            u = torch.rand(m.dt_bias.shape, generator=generator)
            dt = torch.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3)))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def static_horizons(model) -> list[torch.Tensor]:
    """Per linear layer, H_s = ln(eps) / g with g = -exp(A_log) softplus(-0.3 + dt_bias), one
    value per unit: [num_value_heads] for GDN, [num_heads * head_dim] for KDA."""
    out = []
    with torch.no_grad():
        for m in decay_modules(model):
            a = m.A_log.float().exp().reshape(-1)  # [H]
            dt_bias = m.dt_bias.float().reshape(a.shape[0], -1)  # [H, 1] or [H, K]
            g = -a[:, None] * F.softplus(STATIC_GATE_INPUT + dt_bias)
            out.append((math.log(HORIZON_EPS) / g).reshape(-1))
    return out


def build_model(name: str, seed: int) -> torch.nn.Module:
    """A freshly initialised fp32 model with deliberate decay parameters."""
    torch.manual_seed(seed)
    if name == "kimi-linear-tiny":
        model = KimiLinearForCausalLM(kimi_config())
    elif name == "qwen3-next-tiny":
        model = Qwen3NextForCausalLM(qwen_config())
    else:
        raise ValueError(f"unknown model {name!r}; known: {MODEL_NAMES}")
    init_decay(model, torch.Generator().manual_seed(seed + 1))
    return model.float()


def check_patch(model, seq_len: int = 96) -> tuple[float, float]:
    """Loss of a random batch with the original and with the fast chunk path; also verifies
    the fast function is the one called.  Returns (original loss, fast loss)."""
    ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    calls = {"n": 0}
    fast = fast_kda_chunk if isinstance(model, KimiLinearForCausalLM) else fast_gdn_chunk

    def counting(*args, **kwargs):
        calls["n"] += 1
        return fast(*args, **kwargs)

    losses = []
    with torch.no_grad():
        set_fast_chunks(False)
        losses.append(model(input_ids=ids, labels=ids).loss.item())
        set_fast_chunks(True)
        kimi_mod.chunk_kimi_delta_attention = counting
        qwen_mod.torch_chunk_gated_delta_rule = counting
        losses.append(model(input_ids=ids, labels=ids).loss.item())
        set_fast_chunks(True)
    num_linear = LAYER_TYPES.count("linear_attention")
    if calls["n"] != num_linear:
        raise RuntimeError(f"fast chunk called {calls['n']} times, expected {num_linear}")
    return losses[0], losses[1]
