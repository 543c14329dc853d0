"""Random-weight HF checkpoints with the per-layer shapes of the real hybrid models.

    python -m model_runner.bench.real_shape_models NAME [--layers N] [--experts N]
        [--dtype bfloat16]
        [--vocab-size N] [--seed 0] [--cache-dir DIR]

prints the folder it wrote (or found already written).  Folders are cached under
``$DASC_CACHE_DIR/models`` (default ``~/.cache/dasc/models``), one per distinct set of options;
nothing here is committed.  Shapes are the public configs' (SPEC §5):

- ``qwen3-next-shape``: Qwen3-Next-80B-A3B's linear heads (16 key / 32 value heads of 128, conv
  kernel 4) and gated attention (16 q / 2 kv heads of 256, partial rotary 0.25), every 4th layer
  full attention, experts 512 wide with a 512-wide sigmoid-gated shared expert; cut to 8 layers,
  hidden 1,024 and 8 experts top-2 (the model of the vLLM-CPU comparison,
  docs/benchmarks.md).
- ``kimi-linear-shape``: Kimi-Linear-48B-A3B's KDA (32 heads of 128, three convs of kernel 4),
  MLA (32 heads, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, no q-LoRA), hidden 2,304,
  experts 1,024 wide top-8 with one shared expert, layer 1 dense (9,216); cut to 8 layers
  (3 KDA : 1 MLA) and 16 experts.
- ``qwen3.5-0.8b``: Qwen3.5-0.8B's language model whole (``Qwen3_5ForCausalLM``): 24 layers
  (18 GDN of 16 heads of 128, 6 gated attention of 8 q / 2 kv heads of 256), hidden 1,024,
  MLP 3,584, the real 248,320-token vocabulary with tied embeddings.
- ``qwen3.5-35b-a3b-shape``: Qwen3.5-35B-A3B's layers (GDN 16 key / 32 value heads of 128,
  attention 16 q / 2 kv heads of 256, hidden 2,048, experts 512 wide top-8 and a 512-wide
  shared expert), cut to 8 layers and 16 experts, the real vocabulary.
- ``olmo-hybrid-7b-shape``: OLMo-Hybrid-7B's layers (GDN 30 heads, keys 96 / values 192 wide,
  beta up to 2; post-norm attention of 30 heads of 128; hidden 3,840, MLP 11,008), cut to 8
  layers, its 100,352-token vocabulary.

The first two default to the byte tokenizer's 264 ids as their vocabulary, the Qwen3.5 and
OLMo ones to the real vocabulary: their tokenizer is the byte tokenizer with every id past its
own given a three-character text of printable ASCII, so text encodes to bytes as before and
whatever id the model samples decodes to text (load generators count empty answers as
errors).  The byte tokenizer's (its files are copied in, so the folder
serves text), the lm_head being the one shape that is not the real one.  Weights are N(0, 0.02);
decay parameters take fla's init (A_log = log U(1, 16), dt_bias = softplus^-1(dt), dt ~ logU(1e-3,
1e-1)), so retention horizons spread as in trained models rather than transformers' dt_bias = 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)  # transformers' pure-torch path on CPU (fla needs a GPU)

import torch  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "model_runner" / "assets" / "qwen3-next-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
NAMES = ("qwen3-next-shape", "kimi-linear-shape", "qwen3.5-0.8b", "qwen3.5-35b-a3b-shape",
         "olmo-hybrid-7b-shape")
DEFAULT_EXPERTS = {"qwen3-next-shape": 8, "kimi-linear-shape": 16, "qwen3.5-0.8b": 0,
                   "qwen3.5-35b-a3b-shape": 16, "olmo-hybrid-7b-shape": 0}
DEFAULT_LAYERS = {"qwen3.5-0.8b": 24}  # the others: 8
DEFAULT_VOCAB = {"qwen3.5-0.8b": 248320, "qwen3.5-35b-a3b-shape": 248320,
                 "olmo-hybrid-7b-shape": 100352}  # the others: the byte tokenizer's 264


def layer_types(num_layers: int) -> list[str]:
    """Every 4th layer is full attention (both real models use 3 linear : 1 full)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(num_layers)]


def qwen3_next_shape(num_layers: int, num_experts: int, vocab_size: int, **over) -> dict:
    cfg = dict(
        vocab_size=vocab_size, hidden_size=1024, num_hidden_layers=num_layers,
        layer_types=layer_types(num_layers),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25},
        num_experts=num_experts, num_experts_per_tok=min(2, num_experts),
        moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=65536,
        bos_token_id=257, eos_token_id=258, pad_token_id=256)
    cfg.update(over)
    return cfg


def kimi_linear_shape(num_layers: int, num_experts: int, vocab_size: int, **over) -> dict:
    types = layer_types(num_layers)
    full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]  # 1-based, as on disk
    cfg = dict(
        vocab_size=vocab_size, hidden_size=2304, num_hidden_layers=num_layers,
        linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                            "full_attn_layers": full,
                            "kda_layers": [i for i in range(1, num_layers + 1) if i not in full]},
        layer_types=types, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
        num_attention_heads=32, num_key_value_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_local_experts=num_experts, num_experts_per_tok=min(8, num_experts),
        moe_intermediate_size=1024, n_shared_experts=1, intermediate_size=9216,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=65536, bos_token_id=257, eos_token_id=258, pad_token_id=256)
    cfg.update(over)
    return cfg


def qwen3_5_shape(num_layers: int, num_experts: int, vocab_size: int, **over) -> dict:
    """Qwen3.5-0.8B's text config (dense, tied) or, with experts, 35B-A3B's layer shapes."""
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
    common = dict(vocab_size=vocab_size, num_hidden_layers=num_layers,
                  layer_types=layer_types(num_layers), linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, head_dim=256,
                  num_key_value_heads=2, rope_parameters=rope, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, bos_token_id=257, eos_token_id=258,
                  pad_token_id=256)
    if num_experts:
        cfg = dict(common, hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                   num_attention_heads=16, num_experts=num_experts,
                   num_experts_per_tok=min(8, num_experts), moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, tie_word_embeddings=False)
    else:
        cfg = dict(common, hidden_size=1024, linear_num_key_heads=16, linear_num_value_heads=16,
                   num_attention_heads=8, intermediate_size=3584, tie_word_embeddings=True)
    cfg.update(over)
    return cfg


def olmo_hybrid_shape(num_layers: int, vocab_size: int, **over) -> dict:
    cfg = dict(vocab_size=vocab_size, hidden_size=3840, intermediate_size=11008,
               num_hidden_layers=num_layers, layer_types=layer_types(num_layers),
               num_attention_heads=30, num_key_value_heads=30, linear_num_key_heads=30,
               linear_num_value_heads=30, linear_key_head_dim=96, linear_value_head_dim=192,
               linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, rms_norm_eps=1e-6,
               tie_word_embeddings=False, max_position_embeddings=65536, bos_token_id=257,
               eos_token_id=258, pad_token_id=256)
    cfg.update(over)
    return cfg


def spread_decay(a_log: torch.Tensor, dt_bias: torch.Tensor, gen: torch.Generator) -> None:
    """fla's init: A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)."""
    a = torch.empty(a_log.shape).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    a_log.data = a
    dt_bias.data = dt + torch.log(-torch.expm1(-dt))


def build(name: str, num_layers: int | None = None, num_experts: int | None = None,
          vocab_size: int | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
          **over):
    """The transformers model (eval mode): weights N(0, 0.02) in ``dtype``, decays in FP32."""
    import transformers as tf

    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    num_layers, num_experts, vocab_size = resolve(name, num_layers, num_experts, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate once, in the final dtype
    try:
        if name == "qwen3-next-shape":
            model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
                **qwen3_next_shape(num_layers, num_experts, vocab_size, **over)))
        elif name == "kimi-linear-shape":
            model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
                **kimi_linear_shape(num_layers, num_experts, vocab_size, **over)))
        elif name.startswith("qwen3.5"):
            cfg = qwen3_5_shape(num_layers, num_experts, vocab_size, **over)
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**cfg)) if num_experts \
                else tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**cfg))
        else:
            model = tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(
                **olmo_hybrid_shape(num_layers, vocab_size, **over)))
        decays = [(m.A_log, m.dt_bias) for m in model.modules()
                  if hasattr(m, "A_log") and hasattr(m, "dt_bias")]
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 or "norm" in pname:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1 if "norm" in pname
                        else torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
        if name.startswith("qwen"):  # Qwen3-Next and Qwen3.5 store RMSNorm weights as w - 1
            for pname, p in model.named_parameters():
                if "norm" in pname and "linear_attn.norm" not in pname:
                    p.sub_(1.0)
    for a_log, dt_bias in decays:
        spread_decay(a_log, dt_bias, gen)
    model.config._attn_implementation = "eager"
    return model.eval()


def widen_tokenizer(path: Path, vocab_size: int) -> None:
    """Give the byte tokenizer ``vocab_size`` ids: each id past its own decodes to three
    printable ASCII characters (never produced by encoding: there are no merges)."""
    raw = json.loads(path.read_text())
    vocab = raw["model"]["vocab"]
    # the special tokens keep their ids only if the model's vocabulary holds them too
    vocab.update({t["content"]: t["id"] for t in raw["added_tokens"]})
    taken = set(vocab.values())
    chars = [chr(c) for c in range(33, 127)]  # their own byte-level characters
    n = len(chars)
    texts = (chars[i // (n * n)] + chars[i // n % n] + chars[i % n] for i in range(n ** 3))
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[next(texts)] = token_id
    path.write_text(json.dumps(raw, ensure_ascii=False))


def cache_root() -> Path:
    return Path(os.environ.get("DASC_CACHE_DIR", Path.home() / ".cache" / "dasc")) / "models"


def resolve(name: str, num_layers: int | None, num_experts: int | None,
            vocab_size: int | None) -> tuple[int, int, int]:
    """Fill each option left as None with the model's default."""
    return (DEFAULT_LAYERS.get(name, 8) if num_layers is None else num_layers,
            DEFAULT_EXPERTS[name] if num_experts is None else num_experts,
            DEFAULT_VOCAB.get(name, 264) if vocab_size is None else vocab_size)


def ensure(name: str, num_layers: int | None = None, num_experts: int | None = None,
           vocab_size: int | None = None, seed: int = 0, dtype: str = "bfloat16",
           cache_dir: Path | None = None) -> Path:
    """The cached folder for these options, written first if missing (atomically)."""
    num_layers, num_experts, vocab_size = resolve(name, num_layers, num_experts, vocab_size)
    options = dict(name=name, layers=num_layers, experts=num_experts, vocab=vocab_size, seed=seed,
                   dtype=dtype, version=3)
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
    folder = (cache_dir or cache_root()) / f"{name}-{num_layers}l-{num_experts}e-{dtype}-{key}"
    if (folder / "config.json").exists():
        return folder
    model = build(name, num_layers, num_experts, vocab_size, seed, getattr(torch, dtype))
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(str(partial))
    for f in TOKENIZER_FILES:
        shutil.copy(ASSETS / f, partial / f)
    if vocab_size > 264:
        widen_tokenizer(partial / "tokenizer.json", vocab_size)
    (partial / "dasc_shape.json").write_text(json.dumps(options, indent=1) + "\n")
    partial.rename(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("name", choices=NAMES)
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: 24 for qwen3.5-0.8b, 8 for the others)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts (default: 8 for qwen3-next-shape, 16 for kimi-linear-shape "
                        "and qwen3.5-35b-a3b-shape, none for the dense models)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the real vocabulary for the Qwen3.5 and OLMo models, the byte "
                        "tokenizer's 264 ids for the others")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="default: $DASC_CACHE_DIR/models or ~/.cache/dasc/models")
    a = p.parse_args()
    print(ensure(a.name, a.layers, a.experts, a.vocab_size, a.seed, a.dtype, a.cache_dir))


if __name__ == "__main__":
    main()
