"""The CUDA path (fla kernels, CUDA pools, Triton checkpoint kernels) against the CPU path.

Skipped without a GPU; on a GPU machine this is the first check to run:
    python -m pytest -q tests/model_runner/test_cuda_path.py tests/kernels/test_kernels_ragged.py \
        tests/kernels/test_kernels_int8.py
"""

from __future__ import annotations

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import assert_rel_close, snapshot_cuts

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch", ["kda", "gdn"])
def test_cuda_prefill_and_decode_match_cpu(arch, tmp_path):
    make_model(arch, tmp_path)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (70, 9, 33)]
    logits = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(RunnerConfig(str(tmp_path), device=device, num_pages=64,
                                          page_size=16, num_state_slots=4))
        seqs = [SeqInput(p, 0, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 16], i + 1)
                for i, p in enumerate(prompts)]
        steps = [runner.forward(seqs).cpu()]
        for _ in range(8):  # batched decode through fla's fused recurrent kernels
            for s, t in zip(seqs, steps[-1].argmax(-1).tolist()):
                s.prefix_len += len(s.token_ids)
                s.token_ids = [t]
            steps.append(runner.forward(seqs).cpu())
        logits[device] = torch.stack(steps)
    assert_rel_close(logits["cuda"], logits["cpu"], rtol=1e-3)


@pytest.mark.parametrize("arch", ["kda", "gdn"])
def test_cuda_snapshot_step_matches_cpu(arch, tmp_path):
    """A prefill step in which every sequence snapshots its states a third of the way in and
    before its last token (fla's chunk kernels on each round's segments, the copies, its fused
    recurrent kernel on the last tokens): logits, states and snapshots as on the CPU path."""
    make_model(arch, tmp_path)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (70, 9, 2)]
    got = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(RunnerConfig(str(tmp_path), device=device, num_pages=64,
                                          page_size=16, num_state_slots=10))
        seqs = [SeqInput(p, 0, [5 * i + j for j in range(5)], i + 1,
                         [(cut, 4 + 2 * i + j) for j, cut in enumerate(snapshot_cuts(p))])
                for i, p in enumerate(prompts)]
        logits = runner.forward(seqs).cpu()
        got[device] = (logits, runner.state.temporal.cpu(), runner.state.conv.float().cpu())
    for ours, ref in zip(got["cuda"], got["cpu"]):
        assert_rel_close(ours, ref, rtol=1e-3)
