"""Files by concept: a Python file holds one thing and may run to 600 lines doing so; a file
past that holds two and is split where they part."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("client", "dasc_server", "kernels", "loadgen", "model_runner", "scheduler", "scripts",
           "tests")
MAX_LINES = 600


def line_counts(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): len(path.read_text().splitlines())
            for folder in FOLDERS for path in sorted((root / folder).rglob("*.py"))}


def test_every_python_file_is_small():
    counts = line_counts(ROOT)
    assert len(counts) > 100  # the walk found the project
    too_long = {path: n for path, n in counts.items() if n > MAX_LINES}
    assert not too_long, f"files over {MAX_LINES} lines: {too_long}"


def test_a_long_file_is_found(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert line_counts(tmp_path) == {"scheduler/long.py": MAX_LINES + 1}
