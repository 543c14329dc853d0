"""dasc-serve on CUDA (fla kernels, NCCL at TP=2, CUDA pools and Triton checkpoint kernels)
against the CPU path.  Skipped without a GPU; ``tests/gpu/validate.sh`` runs it."""

from __future__ import annotations

import time

import pytest
import torch
from support.serving import KIMI, running_server
from support.serving_reference import FAMILY, PROMPT_A, PROMPT_B, Reference, offline_arm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
READY_S = 900  # a cold Triton cache: the server compiles fla's kernels and captures its graphs


@pytest.fixture(scope="module", autouse=True)
def warm_triton_cache():
    """Compile (and autotune) fla's kernels at this model's shapes once, in this process: the
    servers then load them from Triton's disk cache instead of compiling inside a request
    (whose client timeout is 120 s)."""
    from model_runner.batch import SeqInput
    from model_runner.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(str(KIMI), device="cuda", num_pages=64, page_size=16,
                                      num_state_slots=4))
    seqs = [SeqInput(PROMPT_A, 0, list(range(16)), 1), SeqInput(PROMPT_B[:9], 0,
                                                                 list(range(16, 32)), 2)]
    next_ids = runner.forward(seqs).argmax(-1).tolist()
    for seq, token in zip(seqs, next_ids):
        seq.prefix_len, seq.token_ids = len(seq.token_ids), [token]
    runner.forward(seqs)
    torch.cuda.synchronize()


@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_server_dense_tokens_equal_the_cpu_engine(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ref = Reference(KIMI)
    with running_server("--model", str(KIMI), "--device", "cuda", "--tp", str(tp),
                        "--checkpoint-interval", "32", timeout=READY_S) as server:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_B, PROMPT_A, *FAMILY):
            body = server.complete(prompt, max_tokens=6, ignore_eos=True)
            assert body["choices"][0]["token_ids"] == ref(prompt)[:6]


def test_cuda_server_nr_hit_matches_the_cpu_arm():
    context, question = list(b"The sky is blue. abcde: 12345. " * 8), list(b"\nvalue of abcde:")
    with running_server("--model", str(KIMI), "--device", "cuda", "--wmax", "128",
                        "--checkpoint-interval", "0", timeout=READY_S) as server:
        server.complete(context, max_tokens=1)
        body = server.complete(context + question, max_tokens=8, ignore_eos=True, logprobs=0)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(context)
    tokens, logprobs = offline_arm(KIMI, "nr@128", context, question)
    assert body["choices"][0]["token_ids"] == tokens
    served = torch.tensor(body["choices"][0]["logprobs"]["token_logprobs"])
    torch.testing.assert_close(served, torch.tensor(logprobs), rtol=0, atol=2e-3)


@pytest.mark.parametrize("tier", ["files", "host memory"])
def test_cuda_tier_hit_gives_the_tokens_of_a_pool_hit(tmp_path, tier):
    """The second tier on CUDA (a device-to-host copy per spill; pinned host memory with
    ``--host-tier-bytes``): a tier hit restores the bytes a pool hit restores."""
    prompts = [[40 + (i * 7 + j) % 80 for j in range(300)] for i in range(4)]
    follow = prompts[0] + list(b" and then?")
    flags = ("--model", str(KIMI), "--device", "cuda")
    with running_server(*flags, timeout=READY_S) as server:  # 64 slots: the pool keeps all
        server.complete(prompts[0], max_tokens=4, ignore_eos=True)
        pool = server.complete(follow, max_tokens=4, ignore_eos=True)
    kind = (("--cache-tier-dir", str(tmp_path)) if tier == "files"
            else ("--host-tier-bytes", "64M"))
    with running_server(*flags, "--checkpoint-slots", "2", "--no-park-finished", *kind,
                        timeout=READY_S) as server:
        for prompt in prompts:
            server.complete(prompt, max_tokens=4, ignore_eos=True)
        for _ in range(100):  # the writes leave the step
            if server.stats()["tier"]["entries"] >= 6:
                break
            time.sleep(0.1)
        hit = server.complete(follow, max_tokens=4, ignore_eos=True)
        assert server.stats()["tier"]["fetches"] == 1
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in (pool, hit)]
    assert cached == [len(prompts[0]) - 1] * 2
    assert hit["choices"][0]["token_ids"] == pool["choices"][0]["token_ids"]
