"""What can be checked of a model folder before torch is imported: the TP degree against
``config.json`` and the safetensors files' headers.  The launchers (``dasc-serve``,
``dasc-generate``) check these before starting any process; importing torch and the model code
for them cost each launcher ~3 s of CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from model_runner.config import ConfigError, ModelConfig

__all__ = ["WeightsError", "check_tp", "check_weight_files", "weight_files"]


class WeightsError(ValueError):
    """Weights missing or unreadable; the message names the file and the tensor."""


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
            raise ConfigError(f"{source}: field {cfg.field_name(field)!r}={value} is not "
                              f"divisible by tp={tp_size}")
    kv, kv_field = cfg.num_key_value_heads, cfg.field_name("num_key_value_heads")
    if cfg.architecture == "OlmoHybridForCausalLM" and kv % tp_size:  # k_norm spans every head
        raise ConfigError(f"{source}: field {kv_field!r}={kv} is not divisible by "
                          f"tp={tp_size}")
    if not cfg.is_kda and kv % tp_size and tp_size % kv:
        raise ConfigError(f"{source}: field {kv_field!r}={kv} neither divides nor is a "
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
            with safe_open(str(path), framework="numpy") as f:
                f.keys()
        except SafetensorError as e:
            raise WeightsError(f"{path}: unreadable safetensors file ({e})") from None
