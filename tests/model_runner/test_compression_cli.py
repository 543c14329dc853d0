"""`dasc-plan` end to end: the public configs (as a subprocess) and a tiny model with weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file
from support.paths import DATA, ROOT

from model_runner.compression.analysis.plan_cli import main
from model_runner.compression.horizons import random_decay_params
from model_runner.compression.plan import ModelIdentity, SelectionPlan
from model_runner.compression.weights import decay_tensor_names, load_decay_params
from model_runner.config import ModelConfig


def dasc_plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "model_runner.compression.analysis.plan_cli", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    "name, per_slot, budget",
    [("kimi-linear-48b-a3b-instruct", 5_427_200, 694_681_600),
     ("qwen3-next-80b-a3b-instruct", 9_658_368, 1_236_271_104)],
)
def test_dense_row_from_config_only(name: str, per_slot: int, budget: int) -> None:
    proc = dasc_plan_cli(str(DATA / "configs" / name), "--tp", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["dense"] == {"bytes_per_rank_per_slot": per_slot, "budget_bytes": budget,
                            "slots": 127}
    assert [(r["w_max"], r["selector"], r["slots"]) for r in out["rows"]] == [(0, "dense", 127)]
    assert "dense row only" in proc.stderr


def test_table_and_custom_budget(capsys) -> None:
    cfg_file = DATA / "configs" / "kimi-linear-48b-a3b-instruct" / "config.json"
    assert main([str(cfg_file), "--tp", "8", "--budget-bytes", str(10 * 5_427_200)]) == 0
    out = capsys.readouterr().out
    assert "5,427,200" in out and "54,272,000" in out
    assert out.splitlines()[-1].split()[-2] == "9"  # floor(10) - 1 slots


def test_bad_tp_exits_non_zero_with_one_line() -> None:
    proc = dasc_plan_cli(str(DATA / "configs" / "qwen3-next-80b-a3b-instruct"), "--tp", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("dasc-plan: error: TP degree 3 does not divide the 16 "
                           "linear-attention key heads\n")


@pytest.mark.parametrize(
    "args, message",
    [(["--tp", "8", "--wmax", "-4"], "W_max must be a finite number >= 0"),
     (["--tp", "8", "--wmax", "16"], "has no safetensors weights"),
     (["--tp", "8", "--plot", "x.png"], "has no safetensors weights"),
     (["--tp", "8", "--save-plan", "x.json"], "--save-plan needs exactly one --wmax"),
     (["--tp", "0"], "TP degree must be a positive integer")],
)
def test_bad_input_one_line_error(args: list[str], message: str, capsys) -> None:
    assert main([str(DATA / "configs" / "qwen3-next-80b-a3b-instruct"), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_missing_config(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path), "--tp", "1"]) == 2
    assert "config.json: file not found" in capsys.readouterr().err


def tiny_model(tmp_path: Path) -> tuple[Path, ModelConfig]:
    src = DATA / "compression" / "tiny-kda"
    cfg = ModelConfig.from_dir(src)
    params = random_decay_params(cfg, seed=21)
    tensors = {}
    for i, layer in enumerate(cfg.linear_layer_ids):
        a_name, dt_name = decay_tensor_names(cfg, layer)
        tensors[a_name] = params.A_log[i].reshape(1, 1, -1, 1).clone()
        tensors[dt_name] = params.dt_bias[i].clone()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(model / "model.safetensors"))
    return model, cfg


def test_rows_plan_and_plot_with_weights(tmp_path: Path, capsys) -> None:
    model, cfg = tiny_model(tmp_path)
    plot = tmp_path / "h.png"
    assert main([str(model), "--tp", "2", "--wmax", "16", "128", "--int8", "--json",
                 "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    # fp32: dense + 2 W_max x 3 placements; the same again in int8
    assert len(rows) == 2 * (1 + 2 * 3)
    keyed = {(r["w_max"], r["placement"], r["payload"]): r for r in rows}
    for w in (16.0, 128.0):
        off, hyb = keyed[(w, "off", "fp32")], keyed[(w, "hybrid", "fp32")]
        assert 0 < off["retained_fraction"] < 1
        assert hyb["bytes_per_rank_per_slot"] <= off["bytes_per_rank_per_slot"]
        assert keyed[(w, "off", "int8")]["bytes_per_rank_per_slot"] < off[
            "bytes_per_rank_per_slot"]
        assert off["c_temp_rag"] >= off["c_temp_pad"]
        assert 4 <= off["refresh_window"] <= w
    assert keyed[(128.0, "off", "fp32")]["retained_fraction"] < keyed[(16.0, "off", "fp32")][
        "retained_fraction"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"

    plan_file = tmp_path / "plan.json"
    assert main([str(model), "--tp", "2", "--wmax", "64", "--save-plan", str(plan_file)]) == 0
    plan = SelectionPlan.load(plan_file)
    assert plan.w_max == 64.0 and plan.selector == "dasc"
    plan.check_matches(ModelIdentity.of(cfg, load_decay_params(model, cfg)))
    assert main([str(model), "--tp", "2", "--wmax", "64", "--random-seed", "5", "--save-plan",
                 str(plan_file)]) == 0
    randomised = SelectionPlan.load(plan_file)
    assert randomised.selector == "random" and randomised.retained_counts == plan.retained_counts


def test_help_mentions_every_option() -> None:
    proc = dasc_plan_cli("--help")
    assert proc.returncode == 0
    for option in ("--tp", "--wmax", "--budget-bytes", "--dense-slots", "--int8", "--json",
                   "--plot", "--save-plan", "--layout", "--random-seed"):
        assert option in proc.stdout

