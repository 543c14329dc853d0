"""Read only the decay parameters (A_log, dt_bias) of every linear layer from safetensors.

A model directory holds either `model.safetensors` or shards named by
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Layer i uses
    GDN: model.layers.{i}.linear_attn.{A_log [H_v], dt_bias [H_v]}
         (model.language_model.layers.{i}... in Qwen3.5's ...ForConditionalGeneration)
    KDA: model.layers.{i}.self_attn.{A_log (1,1,H,1), dt_bias (H*K,)}
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from model_runner.compression.horizons import DecayParams
from model_runner.config import ModelConfig
from model_runner.model_files import WeightsError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def decay_tensor_names(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    """On-disk names of (A_log, dt_bias) for model layer `layer` (0-based)."""
    module = "self_attn" if cfg.is_kda else "linear_attn"
    prefix = f"{cfg.weights_prefix}layers.{layer}.{module}"
    return f"{prefix}.A_log", f"{prefix}.dt_bias"


def has_weights(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return (d / INDEX_NAME).is_file() or (d / SINGLE_NAME).is_file()


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
            return {name: model_dir / file for name, file in raw["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
    single = model_dir / SINGLE_NAME
    if not single.is_file():
        raise WeightsError(f"{model_dir}: no {SINGLE_NAME} or {INDEX_NAME}")
    try:
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise WeightsError(f"{single}: unreadable ({e})") from None


def load_decay_params(model_dir: str | Path, cfg: ModelConfig) -> DecayParams:
    """Decay parameters of all linear layers as fp32; raises WeightsError naming what is missing."""
    model_dir = Path(model_dir)
    where = _weight_map(model_dir)
    wanted = [decay_tensor_names(cfg, i) for i in cfg.linear_layer_ids]
    by_file: dict[Path, list[str]] = {}
    for pair in wanted:
        for name in pair:
            if name not in where:
                raise WeightsError(f"{model_dir}: tensor {name!r} not found")
            by_file.setdefault(where[name], []).append(name)
    tensors = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise WeightsError(f"{file}: shard file not found")
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    try:
        return DecayParams.from_layers(
            cfg, [tensors[a] for a, _ in wanted], [tensors[d] for _, d in wanted]
        )
    except ValueError as e:
        raise WeightsError(f"{model_dir}: {e}") from None
