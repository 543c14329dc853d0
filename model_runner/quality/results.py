"""The quality study's results on disk: JSON lines of ``Result``, appended as a sweep runs, read
back by ``dasc-eval`` (to resume), ``dasc-eval report`` and ``dasc-eval study``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from model_runner.processes import is_first_rank
from model_runner.quality.sweep import Result


def markdown_table(results: list[Result], tasks: list[str]) -> str:
    """Rows in the shape of the paper's Table 2: arm, length, one column per subtask, average."""
    head = "| Arm | Len | " + " | ".join(t.upper() for t in tasks) + " | Avg |"
    lines = [head, "|" + "---|" * (len(tasks) + 3)]
    keys = sorted({(r.label, r.length) for r in results}, key=lambda k: (k[0] != "dense", k))
    for label, length in keys:
        acc = {r.task: r.accuracy for r in results if r.label == label and r.length == length}
        cells = [f"{acc[t]:.2f}" for t in tasks]
        avg = sum(acc[t] for t in tasks) / len(tasks)
        lines.append(f"| {label} | {length} | " + " | ".join(cells) + f" | {avg:.2f} |")
    return "\n".join(lines)


def load_results(path: str | Path) -> list[Result]:
    """Results from a JSON-lines file; a line cut short by an interrupted run is skipped."""
    results = []
    if not Path(path).exists():
        return results
    for line in Path(path).read_text().splitlines():
        try:
            results.append(Result.from_json(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return results


def appender(path: str | Path):
    """emit(results): append JSON lines to ``path`` and flush (rank 0 only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with path.open("a") as f:  # end a line an interrupted run cut short
            f.write("\n")

    def emit(results: list[Result]) -> None:
        if not is_first_rank():
            return
        with path.open("a") as f:
            for r in results:
                f.write(json.dumps(r.to_json()) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return emit
