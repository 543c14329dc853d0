"""Runs on every torchrun rank: the runner scenarios for each job of a JSON spec.

Usage (by tests): torchrun --nproc-per-node N tests/support/tp_worker.py SPEC.json OUT_DIR
Rank 0 saves job{i}.pt; every rank also checks that its sampled tokens equal rank 0's.  A job
may set ``config`` (``RunnerConfig`` fields: dtype, coded_weights, ...) and ``pack_all`` (every
linear gets a packed copy, however small).
"""

from __future__ import annotations

import json
import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import model_runner.layers.linear as linear_module  # noqa: E402
from model_runner.parallel import init_tp_group, shutdown_tp_group  # noqa: E402
from support.runner_scenarios import make_runner, run_scenarios  # noqa: E402


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    out_dir = sys.argv[2]
    tp = init_tp_group(torch.device("cpu"))
    pack_min = linear_module.PACK_MIN_ELEMENTS
    for i, job in enumerate(spec["jobs"]):
        linear_module.PACK_MIN_ELEMENTS = 0 if job.get("pack_all") else pack_min
        runner = make_runner(job["model_dir"], tp, job.get("head_order"),
                             job.get("cuda_graph_max_bs", 0), **job.get("config", {}))
        res = run_scenarios(runner, job["prompts"], job["steps"])
        res["released"] = sum(m.weight is None for m in runner.model.modules()
                              if isinstance(m, linear_module.PackedGemm))
        mine = torch.cat(res["tokens"])
        first = mine.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(mine, first), f"rank {tp.rank} sampled different tokens"
        if tp.rank == 0:
            torch.save(res, f"{out_dir}/job{i}.pt")
    shutdown_tp_group(tp)


if __name__ == "__main__":
    main()
