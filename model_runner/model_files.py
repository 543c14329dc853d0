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

__all__ = ["WeightsError", "check_tp", "check_weight_files", "checkpoint_dtype", "resolve_dtype",
           "weight_files"]


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


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype config.json says the weights are in (``dtype``, or the older ``torch_dtype``;
    in ``text_config`` for Qwen3.5 as shipped); None if it says nothing or cannot be read."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for cfg in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        if isinstance(cfg, dict):
            for key in ("dtype", "torch_dtype"):
                if isinstance(cfg.get(key), str):
                    return cfg[key]
    return None


def resolve_dtype(requested: str, model_dir: str | Path, device: str,
                  native_bf16: bool | None = None) -> str:
    """``--dtype auto``: bfloat16 for a bf16 checkpoint on a device that computes bf16 natively
    (CUDA, or a CPU with AVX512-BF16 or AMX), float32 otherwise (an fp32 checkpoint, or a CPU
    that only emulates bf16, where fp32 is several times faster).  Any other request stands."""
    if requested != "auto":
        return requested
    if checkpoint_dtype(model_dir) != "bfloat16":
        return "float32"
    if device.startswith("cuda"):
        return "bfloat16"
    if native_bf16 is None:
        from model_runner.cpu_features import cpu_has_native_bf16

        native_bf16 = cpu_has_native_bf16()
    return "bfloat16" if native_bf16 else "float32"
