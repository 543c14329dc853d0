"""Files by concept: a Python file holds one thing and may run to 600 lines doing so (a file
past that holds two and is split where they part); tests mirror the packages they test."""

from __future__ import annotations

from pathlib import Path

from support.paths import ROOT

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


PACKAGES = ("client", "dasc_server", "kernels", "loadgen", "model_runner", "scheduler", "scripts")


def misplaced_tests(tests: Path) -> list[str]:
    """Python files of ``tests`` outside the layout: a test module sits in the folder of the
    package it tests (``tests/<package>/``) or, when it checks the whole project, at the top; a
    helper sits in ``tests/support/``; ``conftest.py`` anywhere."""
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        if "__pycache__" in rel.parts or path.name == "conftest.py":
            continue
        is_test = path.name.startswith("test_")
        if folder == "support" and len(rel.parts) == 2 and not is_test:
            continue
        if is_test and (folder == "" or (folder in PACKAGES and len(rel.parts) == 2)):
            continue
        wrong.append(str(rel))
    return wrong


def test_tests_mirror_the_packages():
    assert (ROOT / "tests" / "support" / "__init__.py").is_file()
    assert misplaced_tests(ROOT / "tests") == []


def test_a_misplaced_test_file_is_found(tmp_path):
    for rel in ("test_top.py", "scheduler/test_a.py", "support/helpers.py", "conftest.py",
                "helpers.py", "support/test_b.py", "nowhere/test_c.py", "scheduler/helpers.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert misplaced_tests(tmp_path) == ["helpers.py", "nowhere/test_c.py",
                                         "scheduler/helpers.py", "support/test_b.py"]
