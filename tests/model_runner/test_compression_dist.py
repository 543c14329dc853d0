"""Multi-rank checkpoint store/load over real gloo (torchrun), TP = 2 and 4.

The ranks assert exactness themselves (see compression_dist_worker.py); here we check that all of
them finished, that every format and placement ran, and that rows really crossed ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT, SUPPORT

WORKER = SUPPORT / "compression_dist_worker.py"


@pytest.mark.parametrize("world", [2, 4])
def test_store_load_across_ranks(tmp_path: Path, world: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    checks = reports[0]["checks"]
    assert all(len(r["checks"]) == len(checks) for r in reports)
    pool_checks = [c for c in checks if c.startswith("tiny-")]
    # 2 models x 4 plans x 2 layouts x 2 payloads x 3 placements
    assert len(pool_checks) == 96
    assert sum(c.startswith("exchange") for c in checks) == 8
    for placement in ("storage", "hybrid"):
        moved = [c for c in pool_checks if f"placement='{placement}'" in c
                 and "'moved': 0," not in c]
        assert moved, f"no {placement} check moved rows between ranks"
    assert all("'moved': 0," in c for c in pool_checks if "placement='off'" in c)
