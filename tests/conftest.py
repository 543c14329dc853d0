"""Shared test setup.

fla: transformers binds fla's Triton kernels when its Qwen3-Next / Kimi-Linear modules are
imported and fla is importable, and those kernels cannot run the CPU references.  Without a CUDA
device fla is blocked for the whole session (nothing here may reach its kernels).  With one, the
two modules are imported first with fla blocked, then fla for real (`reference_imports`), so the
CUDA tests reach `fla.ops` and helpers such as `random_checkpoints` find fla taken (their
`sys.modules.setdefault("fla", None)` does nothing).

TF32: on NVIDIA, fla's chunk kernels run their fp32 `tl.dot`s in TF32 unless told otherwise.
Emulated, that puts `test_cuda_path` at 7.4e-3 (KDA) / 4.9e-3 (GDN) max error against its bound
of 2.3e-3; with `TRITON_F32_DEFAULT=ieee` at 3.9e-4 / 1.0e-3.  So with a CUDA device the session
(and the servers it starts, which inherit the environment) runs with it.  It is a test setting:
the product keeps Triton's default.  (fla's `solve_tril` dots ask for TF32 explicitly and keep
it; the figures above include that.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.paths import ROOT, TESTS
from support.reference_imports import import_references_then_fla
from support.serving import Server, running_server
from xdist.scheduler import LoadFileScheduling

if torch.cuda.is_available():
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    import_references_then_fla()
else:
    sys.modules.setdefault("fla", None)

# The tiny models issue thousands of small ops; with several threads on 2 shared cores the
# OpenMP barriers cost more than the work (torchrun ranks get OMP_NUM_THREADS=1 the same way).
# The environment variable carries it to every subprocess a test starts (dasc-eval,
# dasc-generate, ...): 3 quick dasc-eval instances take 0.4 s with one thread, 5-14 s with two.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"



def run_torchrun(nproc: int, script: Path, *args: str, timeout: float = 600.0
                 ) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` gloo ranks with real torchrun; raise with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{TESTS}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun x{nproc} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def default_server() -> Iterator[Server]:
    """One dasc-serve with no flags (the built-in Kimi model), started once for every module
    that asks for it.  Their tests share it in any order: they read counters as deltas and
    flush the cache before relying on a miss.  Under xdist one worker runs all those modules
    (`ModuleScheduling`), so it starts once."""
    with running_server() as server:
        yield server


# ---- markers (pyproject.toml declares them): a fast subset is -m "not serving and not dist and
# not slow and not gpu".  Read from each module's source so a new test is marked by what it does.
SLOW_MODULES = {  # minutes of model work each, without a server or torchrun
    "test_offline_eval", "test_quality", "test_table1b", "test_cuda_branches_interpreted",
    "test_kernels_hopper", "test_real_shapes",
}
_MODULE_MARKS: dict[Path, set[str]] = {}


def _module_marks(path: Path) -> set[str]:
    if path not in _MODULE_MARKS:
        source = path.read_text()
        marks = set()
        if ("running_server(" in source or "dasc_server.launch" in source
                or "default_server" in source):
            marks.add("serving")
        if "run_torchrun(" in source or "torchrun(" in source or "--tp\", \"2\"" in source:
            marks.add("dist")
        if path.stem in SLOW_MODULES:
            marks.add("slow")
        _MODULE_MARKS[path] = marks
    return _MODULE_MARKS[path]


DEFAULT_SERVER_SCOPE = "default-server"


class ModuleScheduling(LoadFileScheduling):
    """``--dist loadfile`` (whole modules per worker), except that the modules using the session's
    `default_server` form one scope: one worker runs them all and starts the server once."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.rootpath = config.rootpath
        self.uses_default_server: dict[str, bool] = {}

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        if path not in self.uses_default_server:
            module = self.rootpath / path
            self.uses_default_server[path] = (module.suffix == ".py" and module.is_file()
                                              and "default_server" in module.read_text())
        return DEFAULT_SERVER_SCOPE if self.uses_default_server[path] else path


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return ModuleScheduling(config, log)
    return None


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core, at most 4.  Tests run torch on one
    thread each, so a second worker uses the second core; the servers and torchrun ranks the
    tests start share the same cores."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    heavy = {"serving", "dist", "slow"}
    for item in items:
        path = Path(item.fspath)
        marks = set(_module_marks(path))
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            marks.add("gpu")
        for name in sorted(marks):
            item.add_marker(getattr(pytest.mark, name))
    # Modules that start processes first (a stable sort keeps each module's order): xdist hands
    # out whole modules in this order (--dist loadfile), so the many quick unit-test modules fill
    # both workers' tails instead of one long server module.
    items.sort(key=lambda item: not _module_marks(Path(item.fspath)) & heavy)
