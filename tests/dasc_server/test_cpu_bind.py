"""``dasc-serve --cpu-bind on`` through a real server: every thread of each rank on CPUs of its
own, the scheduler's and the front end's on the CPUs left (or, where none are left, on all of
them), and the server serving as it does unbound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.serving import QWEN, ids, running_server

from loadgen.spawn import descendants

CPUS = sorted(os.sched_getaffinity(0))


def cpus_of(pid: int) -> set[frozenset[int]]:
    """The CPU sets of a process's threads (one set where all agree)."""
    sets = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                sets.add(frozenset(_expand(line.split(":", 1)[1].strip())))
    return sets


def _expand(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def processes(server, needle: str) -> list[int]:
    """The server's processes running ``needle`` (not torchrun's parent of the ranks)."""
    found = []
    for p in descendants(server.proc.pid):
        cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if needle in cmdline and "torchrun" not in cmdline:
            found.append(p)
    return found


@pytest.mark.skipif(len(CPUS) < 2, reason="needs at least two CPUs")
@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_on_its_own_cpus_and_the_rest_on_the_others(tp):
    with running_server("--model", str(QWEN), "--tp", str(tp), "--cpu-bind", "on") as server:
        out = server.complete(ids("the bound ranks serve"), max_tokens=4)
        assert len(out["choices"][0]["token_ids"]) == 4
        ranks = processes(server, "model_runner.serve_rank")
        assert len(ranks) == tp
        for pid in ranks:  # one thread each (OMP_NUM_THREADS=1): CPU local_rank
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes()
                       .decode(errors="replace").split("\0") if "=" in kv)
            assert cpus_of(pid) == {frozenset([CPUS[int(env.get("LOCAL_RANK", "0"))]])}
        rest = frozenset(CPUS[tp:]) or frozenset(CPUS)  # none left: they keep every CPU
        scheduler = processes(server, "-m scheduler")
        assert len(scheduler) == 1
        for pid in [*scheduler, server.proc.pid]:
            assert cpus_of(pid) == {rest}
        assert "--cpu-bind on: this node's ranks on CPUs" in server.log()


def test_bound_ranks_that_outnumber_the_cpus_are_refused_before_anything_starts():
    with pytest.raises(RuntimeError, match=r"need \d+ CPUs, this process may use"):
        with running_server("--model", str(QWEN), "--cpu-bind", "on", "--cpu-threads",
                            str(len(CPUS) + 1), timeout=60):
            pass
