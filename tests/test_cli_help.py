"""Flags and messages of the command-line tools: every flag explains itself and
shows its default in ``--help``; dasc-loadgen names the URL it cannot reach; dasc-plan prints a
legend of its columns, says which files it wrote and plots integer ticks on integer axes."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.paths import ROOT

from client.__main__ import build_parser as client_parser
from dasc_server.flags import build_parser as serve_parser
from loadgen.cli import build_parser as loadgen_parser
from model_runner.bench.bench_cli import build_parser as bench_parser
from model_runner.compression.analysis.plan_cli import build_parser as plan_parser
from model_runner.compression.analysis.plan_cli import main as dasc_plan
from model_runner.generate import build_parser as generate_parser
from model_runner.quality.eval_cli import build_parser as eval_parser
from model_runner.quality.report import build_parser as report_parser
from model_runner.quality.study import build_parser as study_parser
from model_runner.quality.table1b import build_parser as table1b_parser
from scheduler.wire.ipc import free_port

TINY = ROOT / "model_runner" / "assets" / "kimi-linear-tiny"

BUILDERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "python -m client": client_parser, "dasc-loadgen": loadgen_parser,
    "dasc-bench": bench_parser, "dasc-eval": eval_parser, "dasc-eval report": report_parser,
    "dasc-eval study": study_parser, "python -m model_runner.quality.table1b": table1b_parser,
    "dasc-plan": plan_parser, "dasc-generate": generate_parser, "dasc-serve": serve_parser,
}


def with_subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from with_subcommands(sub)


PARSERS = [pytest.param(p, id=p.prog) for build in BUILDERS.values()
           for p in with_subcommands(build())]


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def has_no_default(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Required flags, and flags of a required either-or group, are never left out."""
    return action.required or any(g.required and action in g._group_actions
                                  for g in parser._mutually_exclusive_groups)


def help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag's entry in ``--help`` (its option line plus continuation lines), keyed by its
    first option string, with all whitespace removed so that line wrapping does not matter."""
    entries: dict[str, str] = {}
    key = None
    for line in parser.format_help().splitlines():
        start = re.match(r"  (-[\w-]+)", line)
        if start:
            key = start.group(1)
            entries[key] = line
        elif key is not None and line.startswith("   "):
            entries[key] += line
        else:
            key = None
    return {k: "".join(v.split()) for k, v in entries.items()}


def test_subcommands_are_checked_too() -> None:
    assert len(PARSERS) == len(BUILDERS) + 2  # dasc-bench matched-budget and refresh-cost


@pytest.mark.parametrize("parser", PARSERS)
def test_every_flag_has_help(parser: argparse.ArgumentParser) -> None:
    missing = [a.option_strings[0] for a in flags(parser)
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"{parser.prog}: flags without help: {missing}"


@pytest.mark.parametrize("parser", PARSERS)
def test_help_shows_every_default(parser: argparse.ArgumentParser) -> None:
    entries = help_entries(parser)
    for action in flags(parser):
        flag, default = action.option_strings[0], action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            continue
        shown = "".join(str(default).split())
        assert shown in entries[flag], f"{parser.prog} {flag}: default {default!r} not shown"


@pytest.mark.parametrize("parser", PARSERS)
def test_flags_without_a_default_say_what_happens(parser: argparse.ArgumentParser) -> None:
    for action in flags(parser):
        if action.default is None and not has_no_default(parser, action):
            assert "default" in action.help, (
                f"{parser.prog} {action.option_strings[0]}: help must say what happens when "
                f"the flag is left out")


@pytest.mark.parametrize("extra", [[], ["--token-range", "0", "100"]],
                         ids=["server-info", "token-range"])
def test_loadgen_names_the_url_it_cannot_reach(extra: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "loadgen.cli", "--base-url", url, "--workload",
                           "shared-prefix", "--no-progress", *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "error:" in lines[0], proc.stderr
    assert f"cannot reach {url}" in lines[0]


def test_plan_table_has_a_legend_and_says_what_it_wrote(tmp_path: Path, capsys) -> None:
    plot, plan = tmp_path / "horizons.png", tmp_path / "plan.json"
    assert dasc_plan([str(TINY), "--tp", "1", "--wmax", "64", "--plot", str(plot),
                      "--save-plan", str(plan)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["W_max", "select"])
    legend = "\n".join(lines[lines.index("columns:"):header])
    for column in lines[header].split():
        assert re.search(rf"(^|[\s,]){re.escape(column)}[\s,:]", legend), column
    assert plot.read_bytes()[:4] == b"\x89PNG" and plan.is_file()
    assert f"wrote {plot}\n" in captured.err and f"wrote {plan}\n" in captured.err


def test_plan_plot_has_integer_ticks_on_integer_axes() -> None:
    import matplotlib.pyplot as plt

    from model_runner.compression.analysis.horizon_plot import horizon_figure
    from model_runner.compression.horizons import static_horizons
    from model_runner.compression.weights import load_decay_params
    from model_runner.config import ModelConfig

    cfg = ModelConfig.from_dir(TINY)
    fig = horizon_figure(cfg, static_horizons(cfg, load_decay_params(TINY, cfg)), [16.0])
    try:
        fig.canvas.draw()
        unit_map, head_map, histogram = fig.axes[:3]
        for name, ticks in [("units", unit_map.get_xticks()), ("blocks", unit_map.get_yticks()),
                            ("heads", head_map.get_xticks()), ("blocks", head_map.get_yticks()),
                            ("count", histogram.get_yticks())]:
            assert all(float(t).is_integer() for t in ticks), (name, ticks)
    finally:
        plt.close(fig)


def test_dasc_serve_help_imports_no_torch() -> None:
    """Declaring dasc-serve's flags (its own, the ranks', the scheduler's) must not import
    torch, which takes seconds (``--help`` took 3 s with it)."""
    code = ("import sys; from dasc_server.launch import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("False False"), out


def test_dasc_serve_validates_a_model_folder_without_torch() -> None:
    """The launcher checks the model folder (TP degree, weight headers) before it starts any
    process; importing torch for that cost every start ~3 s of CPU (``model_files.py``)."""
    code = ("import sys; from dasc_server.flags import parse_args, validate\n"
            "validate(parse_args(['--tp', '2']))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out
