"""A runner built inside ``torch.inference_mode`` (a serving rank builds it there) holds ordinary
tensors, so the copies ``kernels.derived`` makes from its weights are kept, not made again on
every call, and its forwards give the bits of a runner built outside."""

from __future__ import annotations

import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), num_pages=64, page_size=PAGE,
                                    num_state_slots=3))


def _decode(runner: ModelRunner, prompt: list[int], steps: int) -> torch.Tensor:
    seq = SeqInput(prompt, 0, list(range(48)), 1)
    logits = [runner.forward([seq])]
    for _ in range(steps):
        seq.prefix_len += len(seq.token_ids)
        seq.token_ids = [int(logits[-1][0].argmax())]
        logits.append(runner.forward([seq]))
    return torch.cat(logits)


def test_runner_built_in_inference_mode_keeps_derived_copies(tmp_path):
    make_model("gdn", tmp_path)  # MoE layers with a shared expert (input-major copies)
    with torch.inference_mode():
        inside = _runner(tmp_path)
        tensors = [*inside.model.parameters(), *inside.model.buffers()]
        assert not any(t.is_inference() for t in tensors)
        shared = next(m for m in inside.model.modules() if hasattr(m, "shared_expert"))
        first, again = shared.shared_expert.input_major(), shared.shared_expert.input_major()
        assert all(a is b for a, b in zip(first, again))
        prompt = list(range(3, 30))
        got = _decode(inside, prompt, 4)
    want = _decode(_runner(tmp_path), prompt, 4)
    assert torch.equal(got, want)
