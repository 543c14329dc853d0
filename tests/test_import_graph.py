"""The project's import graph has no cycle, the HTTP load generator imports no torch, and no test
module imports another.

Every ``import`` counts, also those inside functions: a lazy import only hides a cycle from the
interpreter, not from a reader (``dasc-eval`` once dispatched to the report, which imported its
results reader back from the CLI)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT

PACKAGES = ("client", "dasc_server", "kernels", "loadgen", "model_runner", "scheduler")


def project_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, package: str) -> list[str]:
    """What each import of the module at `path` names: ``a.b`` for ``import a.b``, ``a.b.c`` for
    ``from a.b import c``; relative imports resolved against `package`, the module's own."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + [base] if base else parts)
            names += [f"{base}.{a.name}" for a in node.names]
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name imported from a module counts as that
    module unless it is a submodule itself)."""
    modules = project_modules(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names = imported_names(path, package)
        graph[module] = {m for m in map(owner, names) if m and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_project_has_no_import_cycle():
    assert cycles(import_graph(ROOT)) == []


def test_a_cycle_is_found(tmp_path):
    """The checker itself: a lazy import back into a CLI is a cycle."""
    package = tmp_path / "loadgen"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("def main():\n    from loadgen.report import run\n"
                                    "def load():\n    pass\n")
    (package / "report.py").write_text("from .cli import load\ndef run():\n    pass\n")
    (package / "plain.py").write_text("import loadgen.report\n")
    assert cycles(import_graph(tmp_path)) == [["loadgen.cli", "loadgen.report"]]


def imported_test_modules(tests: Path) -> dict[str, list[str]]:
    """test module of `tests` -> the test modules it imports (``import test_x``, ``from test_x
    import ...``, ``from tests.test_x import ...``, ``from tests import test_x``, relative)."""
    found = {}
    for path in sorted(tests.rglob("test_*.py")):
        parts = [name.split(".") for name in imported_names(path, "tests")]
        modules = {p[1] if p[0] == "tests" and len(p) > 1 else p[0] for p in parts}
        if imported := sorted(m for m in modules if m.startswith("test_")):
            found[path.stem] = imported
    return found


def test_no_test_module_imports_another():
    """What several test modules share lives in a helper module of tests/support/ named for
    what it holds (`serving`, `http_helpers`, `serving_reference`, `runner_scenarios`, ...): a test
    module imported as a library runs its module-level setup in the importer, and a reader
    looking for a helper would have to guess which test needed it first."""
    assert imported_test_modules(ROOT / "tests") == {}


def test_a_test_module_import_is_found(tmp_path):
    """The checker itself: every spelling of an import of a test module, also inside a function;
    a helper module may import what it likes (it is not checked)."""
    (tmp_path / "test_a.py").write_text("import test_b as lane\nfrom serving import ids\n")
    (tmp_path / "test_b.py").write_text("import serving\nfrom serving import test_url\n")
    (tmp_path / "test_c.py").write_text("def f():\n    from tests.test_b import x\n")
    (tmp_path / "test_d.py").write_text("from tests import test_a, serving\nfrom . import test_b\n")
    (tmp_path / "helpers.py").write_text("import test_a\n")
    assert imported_test_modules(tmp_path) == {
        "test_a": ["test_b"], "test_c": ["test_b"], "test_d": ["test_a", "test_b"]}


def imports_torch(modules: tuple[str, ...]) -> bool:
    """Whether importing `modules` in a fresh interpreter loads torch."""
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip() == "True"


def torch_reach(root: Path, package: str) -> dict[str, list[str]]:
    """Module of ``package`` -> a chain of project imports, lazy ones included, that ends in a
    module importing torch or triton itself (none: the module is torch-free)."""
    graph, modules = import_graph(root), project_modules(root)
    direct = {m for m, path in modules.items()
              if any(n.split(".")[0] in ("torch", "triton")
                     for n in imported_names(path, m.rpartition(".")[0]))}
    found = {}
    for start in (m for m in graph if m == package or m.startswith(package + ".")):
        seen, queue = {start: [start]}, [start]
        while queue:
            module = queue.pop(0)
            if module in direct:
                found[start] = seen[module]
                break
            for nxt in sorted(graph[module]):
                if nxt not in seen:
                    seen[nxt] = seen[module] + [nxt]
                    queue.append(nxt)
    return found


def test_the_load_generator_imports_no_torch():
    """No module of ``loadgen``, its experiments included, reaches torch through any import,
    lazy ones included; and importing the package's CLI modules loads none."""
    assert torch_reach(ROOT, "loadgen") == {}
    modules = tuple(sorted(f"loadgen.{p.stem}" for p in (ROOT / "loadgen").glob("*.py")
                           if p.stem != "__init__"))
    assert "loadgen.gateway" in modules
    assert not imports_torch(modules)


def test_a_path_to_torch_is_found(tmp_path):
    """The checker itself: a lazy import two modules away counts."""
    for package in ("loadgen", "model_runner"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "loadgen" / "cli.py").write_text("def main():\n    import loadgen.helper\n")
    (tmp_path / "loadgen" / "helper.py").write_text("from model_runner import heavy\n")
    (tmp_path / "loadgen" / "plain.py").write_text("import json\n")
    (tmp_path / "model_runner" / "heavy.py").write_text("import torch.nn\n")
    assert torch_reach(tmp_path, "loadgen") == {
        "loadgen.cli": ["loadgen.cli", "loadgen.helper", "model_runner.heavy"],
        "loadgen.helper": ["loadgen.helper", "model_runner.heavy"]}


def test_byte_accounting_imports_no_torch():
    """Plans, their JSON and their byte accounting, as a torch-free tool would read them."""
    assert not imports_torch(("model_runner.compression.accounting",
                              "model_runner.compression.plan", "model_runner.compression.balance"))
