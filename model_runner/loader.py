"""Build a model for one TP rank and fill it from HF-format safetensors (single or sharded).

The loader is model-agnostic: the model maps each on-disk name to (parameter, shard id) and
every parameter's own ``weight_loader`` takes its part of the tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model_runner.config import ModelConfig
from model_runner.model_files import WeightsError, weight_files
from model_runner.models.common import HybridForCausalLM
from model_runner.models.kimi_linear import KimiLinearForCausalLM
from model_runner.models.olmo_hybrid import OlmoHybridForCausalLM
from model_runner.models.qwen3_5 import Qwen3_5ForCausalLM
from model_runner.models.qwen3_next import Qwen3NextForCausalLM
from model_runner.parallel import TPGroup

MODEL_CLASSES: dict[str, type[HybridForCausalLM]] = {
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    **{arch: Qwen3_5ForCausalLM for arch in (
        "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")},
}


def build_model(cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                head_order: list[list[int]] | None = None) -> HybridForCausalLM:
    return MODEL_CLASSES[cfg.architecture](cfg, tp, dtype, head_order)


def load_weights(model: HybridForCausalLM, model_dir: Path) -> None:
    """Fill every parameter; tensors the model does not use for serving (a vision tower,
    multi-token-prediction layers) are skipped and, on the first rank, named in one line."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    skipped: dict[str, int] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target, shard_id = model.map_name(name)
                    if target is None:
                        group = ".".join(name.split(".")[:2 if name.startswith("model.") else 1])
                        skipped[group] = skipped.get(group, 0) + 1
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
    if skipped and model.tp.rank == 0:
        groups = ", ".join(f"{group}.* ({n})" for group, n in sorted(skipped.items()))
        print(f"dasc: {model_dir}: not loaded, unused for serving: {groups}", file=sys.stderr,
              flush=True)
    if model.cfg.tie_word_embeddings and ("lm_head.weight", None) not in loaded:
        # one tensor for both (the same vocabulary shard on every rank): at Qwen3.5-0.8B's
        # 248,320 x 1,024 a copy would be 0.5 GB
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add(("lm_head.weight", None))
    def complete(name: str, p: torch.nn.Parameter) -> bool:
        whole = getattr(p, "whole_shard", None)
        return (whole is not None and (name, whole) in loaded) or all(
            (name, s) in loaded for s in p.shard_ids)

    missing = sorted(name for name, p in params.items() if not complete(name, p))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing weights {', '.join(missing[:3])}{more}")
