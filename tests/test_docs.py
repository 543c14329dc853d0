"""The reference docs stay true to the code:
- ``docs/serving.md`` holds ``dasc-serve``'s flag tables exactly as the parser renders them
  (flag, default, help), so a flag added, removed or given a new default without the docs
  fails here (the expected tables print on failure);
- no document or source file speaks of sessions or issue numbers, and no link in the docs
  points outside the repository or at a file that does not exist.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from support.paths import ROOT

from dasc_server.flags import build_parser


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    if action.default is None:
        return "-"
    if isinstance(action.default, str) and "/" in action.default:  # a path of this checkout
        return Path(action.default).name
    return str(action.default)


def flag_tables() -> str:
    """Markdown: one table per argument group of ``dasc-serve``'s parser."""
    parser = build_parser()
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "server" if group.title in ("options", "optional arguments") else group.title
        out += [f"#### {title}", "", "| flag | default | what it does |", "|---|---|---|"]
        for a in actions:
            name = ", ".join(f"`{s}`" for s in a.option_strings)
            if a.choices:
                name += " " + "\\|".join(map(str, a.choices))
            what = (a.help or "").replace("%(default)s", _default(a)).replace("|", "\\|")
            out.append(f"| {name} | {_default(a)} | {what} |")
        out.append("")
    return "\n".join(out)


def test_serving_doc_holds_the_parsers_flag_tables():
    doc = (ROOT / "docs" / "serving.md").read_text()
    tables = flag_tables()
    assert tables in doc, "docs/serving.md's flag tables differ from the parser's:\n\n" + tables


def _project_files() -> list[Path]:
    skip = {".git", ".venv", "node_modules", "__pycache__", "build", "dist"}
    files = []
    for path in ROOT.rglob("*"):
        if path.is_file() and not skip.intersection(path.relative_to(ROOT).parts) \
                and path.suffix in (".py", ".md", ".toml", ".c", ".sh", ".txt", ".cfg", ".yml"):
            files.append(path)
    return files


def test_nothing_speaks_of_sessions_or_issue_numbers():
    pattern = re.compile(r"\b(session|issue) [0-9]", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _project_files()
            if p != Path(__file__).resolve()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits


def test_doc_links_stay_inside_the_repository():
    link = re.compile(r"\]\(([^)#\s]+)[^)]*\)")
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (doc.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                bad.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not bad, bad
