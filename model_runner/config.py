"""Model configuration parsed from a Hugging Face config.json (Qwen3-Next, Qwen3.5 dense and
MoE, OLMo-Hybrid, Kimi-Linear).

One frozen dataclass for every architecture; fields keep the Hugging Face names where one exists.
Everything the runner, the compression plan and the byte accounting need is derived here, so
the plan CLI can work from config.json alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "kimi-linear-tiny"

# `architectures[0]` -> linear-attention kind.  The Qwen3.5 `...ForConditionalGeneration`
# checkpoints (what Qwen ships) keep the language model's fields under `text_config`.
ARCHITECTURES = {
    **dict.fromkeys(("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                     "OlmoHybridForCausalLM"), "gdn"),
    "KimiLinearForCausalLM": "kda",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model; the message names file and field."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # the `architectures[0]` entry
    linear_kind: str  # "gdn" | "kda"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    mlp_types: tuple[str, ...]  # "dense" | "sparse" per layer
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    intermediate_size: int
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # Qwen3-Next gated attention head dim
    rope_theta: float
    partial_rotary_factor: float
    q_lora_rank: int | None  # Kimi MLA
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # linear attention
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    eos_token_id: int | None = None
    linear_beta_scale: float = 1.0  # 2.0: OLMo-Hybrid's negative eigenvalues (beta in [0, 2])
    use_rope: bool = True  # False: no rotary on the full-attention layers (OLMo-Hybrid NoPE)
    # (field, its name in the file where not its own: "text_config.x", ...), for errors
    field_sources: tuple[tuple[str, str], ...] = ()

    def field_name(self, field: str) -> str:
        """The name this config file gives ``field`` (errors name what the user can find)."""
        return dict(self.field_sources).get(field, field)

    @property
    def weights_prefix(self) -> str:
        """Where the language model's tensors live on disk (beside a vision tower in Qwen3.5's
        ``...ForConditionalGeneration`` checkpoints)."""
        if self.architecture.endswith("ForConditionalGeneration"):
            return "model.language_model."
        return "model."

    @property
    def is_kda(self) -> bool:
        return self.linear_kind == "kda"

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layer_ids)

    @property
    def gva_ratio(self) -> int:
        """Value heads per key head (GDN grouped value attention); 1 for KDA."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_conv_dim(self) -> int:
        """Depthwise conv channels of one linear layer (q, k and v together)."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def units_per_head(self) -> int:
        """State units per value head: one (GDN, whole head) or K (KDA, one per key channel)."""
        return self.linear_key_head_dim if self.is_kda else 1

    @property
    def unit_numel(self) -> int:
        """FP32 values in one unit: K*V for a GDN head, V for a KDA channel."""
        v = self.linear_value_head_dim
        return v if self.is_kda else self.linear_key_head_dim * v

    @property
    def mla_qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: file not found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            known = ", ".join(ARCHITECTURES)
            raise ConfigError(f"{source}: architectures={archs!r} is not supported "
                              f"(known: {known})")
        parse = _parse_kda if ARCHITECTURES[arch] == "kda" else _parse_gdn
        text = raw.get("text_config")
        if arch.endswith("ForConditionalGeneration"):
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: {arch} needs a 'text_config' object")
            # the language model's fields; the top level's tie_word_embeddings wins where set
            top = {k: raw[k] for k in ("architectures", "tie_word_embeddings") if k in raw}
            raw, source = {**text, **top}, f"{source}:text_config"
        cfg = parse(_Fields(raw, source))
        if arch.endswith("ForConditionalGeneration"):
            cfg = replace(cfg, field_sources=tuple(
                (f.name, f"text_config.{f.name}") for f in fields(cfg)))
        _validate(cfg, source)
        return cfg


class _Fields:
    """Typed access to config keys with aliases; errors name the file and the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def get(self, *names: str, default=..., kind=int):
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                value = self.raw[name]
                try:
                    if kind is bool:
                        if not isinstance(value, bool):
                            raise TypeError
                        return value
                    return kind(value)
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"{self.source}: field {name!r} must be {kind.__name__}, got {value!r}"
                    ) from None
        if default is ...:
            raise ConfigError(f"{self.source}: missing field {names[0]!r}")
        return default


def _common(f: _Fields) -> dict:
    eos = f.raw.get("eos_token_id")
    return dict(
        architecture=f.raw["architectures"][0],
        vocab_size=f.get("vocab_size"),
        hidden_size=f.get("hidden_size"),
        num_hidden_layers=f.get("num_hidden_layers"),
        rms_norm_eps=f.get("rms_norm_eps", default=1e-6, kind=float),
        hidden_act=f.get("hidden_act", default="silu", kind=str),
        tie_word_embeddings=f.get("tie_word_embeddings", default=False, kind=bool),
        intermediate_size=f.get("intermediate_size", default=0),  # MoE-only models have none
        num_attention_heads=f.get("num_attention_heads"),
        eos_token_id=eos if isinstance(eos, int) else None,
    )


def _parse_gdn(f: _Fields) -> ModelConfig:
    c = _common(f)
    n = c["num_hidden_layers"]
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        interval = f.get("full_attention_interval", default=4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n)]
    num_experts = f.get("num_experts", default=0)
    mlp_only = set(f.raw.get("mlp_only_layers") or [])
    step = f.get("decoder_sparse_step", default=1)
    mlp_types = ["sparse" if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
                 else "dense" for i in range(n)]
    rope = f.raw.get("rope_parameters") or {}
    olmo = c["architecture"] == "OlmoHybridForCausalLM"
    if olmo:  # transformers' defaults where an OLMo-Hybrid config leaves a field out
        heads = c["num_attention_heads"]
        key_heads = f.get("linear_num_key_heads", default=heads)
        key_dim = f.get("linear_key_head_dim", default=int(0.75 * c["hidden_size"] / key_heads))
        f.raw = {"linear_num_key_heads": key_heads, "linear_num_value_heads": heads,
                 "linear_key_head_dim": key_dim, "linear_value_head_dim": 2 * key_dim,
                 "num_key_value_heads": heads, **{k: v for k, v in f.raw.items() if v is not None}}
    return ModelConfig(
        **c,
        linear_kind="gdn",
        layer_types=tuple(layer_types),
        mlp_types=tuple(mlp_types),
        num_experts=num_experts,
        num_experts_per_tok=f.get("num_experts_per_tok", default=0),
        moe_intermediate_size=f.get("moe_intermediate_size", default=0),
        shared_expert_intermediate_size=f.get("shared_expert_intermediate_size", default=0),
        norm_topk_prob=f.get("norm_topk_prob", default=True, kind=bool),
        routed_scaling_factor=1.0,
        num_expert_group=1,
        topk_group=1,
        num_key_value_heads=f.get("num_key_value_heads"),
        head_dim=f.get("head_dim", default=c["hidden_size"] // c["num_attention_heads"]),
        rope_theta=float(rope.get("rope_theta") or f.get("rope_theta", default=10000.0,
                                                         kind=float)),
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor",
                     f.get("partial_rotary_factor", default=1.0 if olmo else 0.25, kind=float))),
        q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
        linear_num_key_heads=f.get("linear_num_key_heads"),
        linear_num_value_heads=f.get("linear_num_value_heads"),
        linear_key_head_dim=f.get("linear_key_head_dim"),
        linear_value_head_dim=f.get("linear_value_head_dim"),
        linear_conv_kernel_dim=f.get("linear_conv_kernel_dim", default=4),
        linear_beta_scale=2.0 if olmo and f.get("linear_allow_neg_eigval", default=True,
                                                kind=bool) else 1.0,
        # transformers gives an OLMo-Hybrid config without rope_parameters the default rotary
        # (theta 10^4); only an explicit "rope_theta": null turns it off (NoPE)
        use_rope=not olmo or "rope_theta" not in rope or rope["rope_theta"] is not None,
    )


def _parse_kda(f: _Fields) -> ModelConfig:
    c = _common(f)
    n = c["num_hidden_layers"]
    lin = f.raw.get("linear_attn_config") or {}
    lf = _Fields(lin, f.source + ":linear_attn_config")
    if "full_attn_layers" in lin and "kda_layers" in lin:
        layer_types = [None] * n
        for i in lin["full_attn_layers"]:  # 1-based in the checkpoint
            layer_types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            layer_types[i - 1] = "linear_attention"
        if None in layer_types:
            raise ConfigError(f"{f.source}: linear_attn_config does not type every layer")
    elif f.raw.get("layer_types") is not None:
        layer_types = f.raw["layer_types"]
    else:
        layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                       for i in range(n)]
    mlp_types = f.raw.get("mlp_layer_types")
    if mlp_types is None:
        dense_first = f.get("first_k_dense_replace", default=1)
        mlp_types = ["dense" if i < dense_first else "sparse" for i in range(n)]
    num_heads = lf.get("num_heads", default=None) or f.get("linear_num_heads", default=32)
    heads_field = "linear_attn_config.num_heads" if lin.get("num_heads") else "linear_num_heads"
    head_dim = lf.get("head_dim", default=None) or f.get("linear_head_dim", default=128)
    kernel = lf.get("short_conv_kernel_size", default=None) or f.get(
        "linear_conv_kernel_dim", default=4)
    q_lora = f.raw.get("q_lora_rank")
    return ModelConfig(
        **c,
        linear_kind="kda",
        layer_types=tuple(layer_types),
        mlp_types=tuple(mlp_types),
        num_experts=f.get("num_experts", "num_local_experts", "n_routed_experts", default=0),
        num_experts_per_tok=f.get("num_experts_per_token", "num_experts_per_tok", default=0),
        moe_intermediate_size=f.get("moe_intermediate_size", default=0),
        shared_expert_intermediate_size=f.get("moe_intermediate_size", default=0)
        * f.get("num_shared_experts", "n_shared_experts", default=1),
        norm_topk_prob=f.get("moe_renormalize", "norm_topk_prob", default=True, kind=bool),
        routed_scaling_factor=f.get("routed_scaling_factor", default=1.0, kind=float),
        num_expert_group=f.get("num_expert_group", "n_group", default=1),
        topk_group=f.get("topk_group", default=1),
        num_key_value_heads=f.get("num_key_value_heads", default=c["num_attention_heads"]),
        head_dim=0,
        rope_theta=0.0,
        partial_rotary_factor=0.0,
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        kv_lora_rank=f.get("kv_lora_rank"),
        qk_nope_head_dim=f.get("qk_nope_head_dim"),
        qk_rope_head_dim=f.get("qk_rope_head_dim"),
        v_head_dim=f.get("v_head_dim"),
        linear_num_key_heads=num_heads,
        linear_num_value_heads=num_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=kernel,
        field_sources=(("linear_num_key_heads", heads_field),
                       ("linear_num_value_heads", heads_field),
                       ("shared_expert_intermediate_size", "moe_intermediate_size")),
    )


def _validate(cfg: ModelConfig, source: str) -> None:
    def fail(field: str, why: str):
        raise ConfigError(f"{source}: field {field!r} {why}")

    if len(cfg.layer_types) != cfg.num_hidden_layers:
        fail("layer_types", f"has {len(cfg.layer_types)} entries for "
             f"{cfg.num_hidden_layers} layers")
    bad = set(cfg.layer_types) - {"linear_attention", "full_attention"}
    if bad:
        fail("layer_types", f"has unknown entries {sorted(bad)}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):
        if getattr(cfg, name) <= 0:
            fail(name, "must be positive")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        fail("linear_num_value_heads", "must be a multiple of linear_num_key_heads")
    if "dense" in cfg.mlp_types and cfg.intermediate_size <= 0:
        fail("intermediate_size", "must be positive when dense MLP layers are present")
    if "sparse" in cfg.mlp_types and (cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0):
        fail("num_experts", "must be positive when MoE layers are present")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        fail("num_key_value_heads", "must divide num_attention_heads")
