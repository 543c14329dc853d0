"""Build a model for one TP rank and fill it from HF-format safetensors (single or sharded).

The loader is model-agnostic: the model maps each on-disk name to (parameter, shard id) and
every parameter's own ``weight_loader`` takes its part of the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model_runner.compression.weights import WeightsError
from model_runner.config import ConfigError, ModelConfig
from model_runner.models.common import HybridForCausalLM
from model_runner.models.kimi_linear import KimiLinearForCausalLM
from model_runner.models.qwen3_next import Qwen3NextForCausalLM
from model_runner.parallel import TPGroup

MODEL_CLASSES: dict[str, type[HybridForCausalLM]] = {
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}


def check_tp(cfg: ModelConfig, tp_size: int, source: str = "config.json") -> None:
    """Every sharded extent must divide by the TP degree; fail before allocating anything."""
    checks = {
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
    }
    if "sparse" in cfg.mlp_types:
        checks["moe_intermediate_size"] = cfg.moe_intermediate_size
        checks["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for field, value in checks.items():
        if tp_size < 1 or value % tp_size:
            raise ConfigError(f"{source}: field {field!r}={value} is not divisible by tp={tp_size}")
    kv = cfg.num_key_value_heads
    if not cfg.is_kda and kv % tp_size and tp_size % kv:
        raise ConfigError(f"{source}: field 'num_key_value_heads'={kv} neither divides nor is a "
                          f"multiple of tp={tp_size}")


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise WeightsError(f"{index}: not a valid safetensors index (needs 'weight_map')"
                               ) from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{model_dir}: no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f}: listed in the index but missing")
    return files


def check_weight_files(model_dir: Path) -> None:
    """Open every weight file's header (cheap): catches missing and truncated files early."""
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except SafetensorError as e:
            raise WeightsError(f"{path}: unreadable safetensors file ({e})") from None


def build_model(cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                head_order: list[list[int]] | None = None) -> HybridForCausalLM:
    return MODEL_CLASSES[cfg.architecture](cfg, tp, dtype, head_order)


def load_weights(model: HybridForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target, shard_id = model.map_name(name)
                    if target is None:
                        continue
                    if target not in params:
                        raise WeightsError(f"{path}: unexpected tensor {name!r}")
                    param = params[target]
                    try:
                        param.weight_loader(param, f.get_tensor(name), shard_id)
                    except (ValueError, RuntimeError, IndexError) as e:
                        raise WeightsError(f"{path}: tensor {name!r}: {e}") from None
                    loaded.add((target, shard_id))
        except SafetensorError as e:
            raise WeightsError(f"{path}: unreadable safetensors file ({e})") from None
    if model.cfg.tie_word_embeddings and ("lm_head.weight", None) not in loaded:
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data)
        loaded.add(("lm_head.weight", None))
    missing = sorted(name for name, p in params.items()
                     if any((name, s) not in loaded for s in p.shard_ids))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing weights {', '.join(missing[:3])}{more}")
