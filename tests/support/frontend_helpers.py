"""Helpers for the front end's unit tests: the tiny model's byte tokenizer (id == UTF-8 byte,
258 = <eos>), which makes ids predictable."""

from __future__ import annotations

from transformers import AutoTokenizer

from support.paths import ROOT

ASSET = ROOT / "model_runner" / "assets" / "kimi-linear-tiny"


def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
