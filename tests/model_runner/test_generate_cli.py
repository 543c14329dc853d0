"""The offline generate command: real subprocesses, TP=2 through its own torchrun launch, and
one-line errors with a non-zero exit for bad input.

The bad-input cases call the command's ``main`` in this process (the start-up of a fresh Python
with torch is most of a subprocess's cost) and read file descriptor 2, so anything a library
prints there still breaks the one-line rule; the TP=2 case still re-launches under torchrun."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.paths import ROOT
from support.random_checkpoints import make_model

from model_runner import generate as generate_cli
from model_runner.config import DEFAULT_MODEL


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_runner.generate", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_default_model_tp1_equals_tp2():
    one = generate("--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "6", "--json")
    two = generate("--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "6", "--json", "--tp", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout.strip().splitlines()[-1])
    assert len(a["token_ids"]) == 6 and a["token_ids"] == b["token_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model"
    make_model("kda", path)
    return path


def _broken_copy(model_dir, tmp_path, edit=None, drop=None):
    dst = tmp_path / "broken"
    shutil.copytree(model_dir, dst)
    if drop:
        (dst / drop).unlink()
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case,expect", [
    ("missing-config", "config.json: file not found"),
    ("malformed-config", "not valid JSON"),
    ("missing-weights", "no *.safetensors"),
    ("unknown-arch", "is not supported"),
    ("missing-field", "missing field 'hidden_size'"),
    ("bad-layer-types", "layer_types"),
    ("tp-not-dividing", "not divisible by tp=3"),
    ("token-outside-vocab", "outside the vocabulary"),
    ("bad-prompt-ids", "comma-separated integers"),
    ("truncated-weights", "unreadable safetensors"),
    ("wrong-shape-weights", "does not fit"),
    ("missing-tensor", "missing weights model.layers.0.mlp.gate_up_proj.weight"),
    ("wrong-shape-weights-tp2", "does not fit"),
])
def test_bad_input_one_line_error(case, expect, model_dir, tmp_path, capfd):
    args = ["--prompt-ids", "5,6,7", "--max-new-tokens", "2"]
    if case == "missing-config":
        d = _broken_copy(model_dir, tmp_path, drop="config.json")
    elif case == "malformed-config":
        d = _broken_copy(model_dir, tmp_path)
        (d / "config.json").write_text("{not json")
    elif case == "missing-weights":
        d = _broken_copy(model_dir, tmp_path, drop="model.safetensors")
    elif case == "unknown-arch":
        d = _broken_copy(model_dir, tmp_path, edit=lambda c: c.update(architectures=["Foo"]))
    elif case == "missing-field":
        d = _broken_copy(model_dir, tmp_path, edit=lambda c: c.pop("hidden_size"))
    elif case == "bad-layer-types":
        d = _broken_copy(model_dir, tmp_path, edit=lambda c: (
            c.pop("linear_attn_config"), c.update(layer_types=["linear_attention"])))
    elif case == "tp-not-dividing":
        d, args = model_dir, args + ["--tp", "3"]
    elif case == "token-outside-vocab":
        d, args = model_dir, ["--prompt-ids", "5,96", "--max-new-tokens", "2"]
    elif case == "bad-prompt-ids":
        d, args = model_dir, ["--prompt-ids", "5,x", "--max-new-tokens", "2"]
    elif case == "missing-tensor":  # half of a merged gate|up parameter
        d = _broken_copy(model_dir, tmp_path)
        weights = load_file(d / "model.safetensors")
        del weights["model.layers.0.block_sparse_moe.up_proj.weight"]
        save_file(weights, d / "model.safetensors")
    elif case.startswith("wrong-shape-weights"):
        d = _broken_copy(model_dir, tmp_path)
        weights = load_file(d / "model.safetensors")
        weights["model.norm.weight"] = torch.ones(3)
        save_file(weights, d / "model.safetensors")
        if case.endswith("tp2"):
            args += ["--tp", "2"]
    else:
        d = _broken_copy(model_dir, tmp_path)
        weights = d / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    capfd.readouterr()
    returncode = generate_cli.main(["--model", str(d), *args])
    stderr = capfd.readouterr().err
    assert returncode != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], stderr


def test_default_model_is_shipped():
    assert (DEFAULT_MODEL / "config.json").is_file()
    assert list(DEFAULT_MODEL.glob("*.safetensors"))
