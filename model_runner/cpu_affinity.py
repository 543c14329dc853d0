"""``dasc-serve --cpu-bind on``: each CPU rank of a node on CPUs of its own, the scheduler and
the front end on the rest.

Unbound, the kernel moves a rank's threads between CPUs and puts the scheduler and the front
end beside them.  Bound, as vLLM-CPU binds its worker by default, the rank keeps its caches
warm and the other processes keep off its CPUs.  Off by default: two servers started on one
machine would both bind their ranks to its first CPUs.

The launcher splits the CPUs it may use (``os.sched_getaffinity``, in order) into this node's
ranks' sets, ``threads`` CPUs each by local rank, and the rest; it hands them down in the
environment (``RANK_CPUS_ENV``, ``REST_CPUS_ENV``) and each process binds itself, every thread
it has, as it starts.
"""

from __future__ import annotations

import os

RANK_CPUS_ENV = "DASC_RANK_CPUS"  # each local rank's CPUs: "0,1;2,3"
REST_CPUS_ENV = "DASC_REST_CPUS"  # the scheduler's and the front end's: "4,5" (may be empty)


def split_cpus(cpus: list[int], ranks: int, threads: int) -> tuple[list[list[int]], list[int]]:
    """(each of ``ranks`` local ranks' ``threads`` CPUs, the CPUs left) from ``cpus`` in order;
    ValueError where they do not go round."""
    if ranks * threads > len(cpus):
        raise ValueError(f"--cpu-bind on: {ranks} rank(s) x {threads} thread(s) need "
                         f"{ranks * threads} CPUs, this process may use {len(cpus)} "
                         f"({_text(cpus)}); lower --cpu-threads or turn --cpu-bind off")
    slices = [cpus[i * threads : (i + 1) * threads] for i in range(ranks)]
    return slices, cpus[ranks * threads :]


def node_plan(ranks: int, threads: int) -> dict[str, str]:
    """The environment that hands this node's split down (``split_cpus`` of the CPUs this
    process may use)."""
    slices, rest = split_cpus(sorted(os.sched_getaffinity(0)), ranks, threads)
    return {RANK_CPUS_ENV: ";".join(_text(s) for s in slices), REST_CPUS_ENV: _text(rest)}


def bind(cpus: list[int]) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def bind_rank() -> None:
    """This rank onto its own CPUs (by ``LOCAL_RANK``) where the launcher handed a split down."""
    spec = os.environ.get(RANK_CPUS_ENV)
    if spec:
        bind(_parse(spec.split(";")[int(os.environ.get("LOCAL_RANK", "0"))]))


def bind_rest() -> list[int] | None:
    """The scheduler's or the front end's CPUs where the split left any; returns them, or
    None where it left none (they then share the ranks')."""
    cpus = _parse(os.environ.get(REST_CPUS_ENV, ""))
    if not cpus:
        return None
    bind(cpus)
    return cpus


def _text(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def _parse(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]
