"""The fixed-shape decode path (what a CUDA graph replays) against the runner's eager decode.

On CPU ``DecodeGraphs`` runs the very step a graph records, eagerly: padded batches, row tables
bucketed by context length, masked batched attention, the fixed-shape MoE.  It must give the
eager decode's greedy tokens and logits, leave the real slots' states equal, and its padding must
write nothing but state slot 0 and the KV scratch row.  With a GPU, replayed graphs must give
the eager CUDA decode's tokens.
"""

from __future__ import annotations

import pytest
import torch
from support.decode_schedule import assert_near, new_runner, run_schedule
from support.random_checkpoints import make_model
from support.runner_scenarios import (
    CONFIGS,
    PAGE,
    STEPS,
    check_against_reference,
    make_runner,
    prompts,
    run_scenarios,
)
from support.serving import KIMI, QWEN

from model_runner.batch import SeqInput
from model_runner.cuda_graph import capture_batch_sizes, context_bucket
from model_runner.layers import mlp


def test_batch_sizes_and_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert [context_bucket(n) for n in (1, 256, 257, 600)] == [256, 256, 512, 1024]


def test_what_the_fixed_shape_path_takes():
    graphs = new_runner(KIMI, "cpu", 4).decode_graphs  # max context 512
    assert graphs.buckets == [256, 512] and graphs.batch_sizes == [1, 2, 4]
    assert graphs.fits([SeqInput([1], 511, [], 1)])
    assert not graphs.fits([SeqInput([1], 512, [], 1)])  # past the largest bucket: eager
    assert not graphs.fits([SeqInput([1, 2], 3, [], 1)])  # prefill
    assert not graphs.fits([SeqInput([1], 3, [], i) for i in range(1, 6)])  # above max bs


MANY_EXPERTS = {"kda-moe64": {"num_local_experts": 64}, "gdn-moe64": {"num_experts": 64}}


@pytest.mark.parametrize("model", ["kimi-tiny", "qwen3-next-tiny", "kda-moe", "gdn-moe",
                                   "kda-moe64", "gdn-moe64"])
def test_static_decode_equals_eager_decode(model, tmp_path, monkeypatch):
    """64 experts top-2: the gathered form at every batch size of the schedule (1 to 8); 4
    experts top-2 with the gathered form capped at 2 pairs: gathered at batch 1, all experts
    from batch 2 on."""
    model_dir = {"kimi-tiny": KIMI, "qwen3-next-tiny": QWEN}.get(model, tmp_path)
    if "-moe" in model:  # the shipped tiny models have dense MLPs only
        make_model(model[:3], tmp_path, **MANY_EXPERTS.get(model, {}))
    if model.endswith("-moe"):
        monkeypatch.setitem(mlp.GATHERED_PAIRS_PER_EXPERT, "cpu", 0.5)
    eager, static = new_runner(model_dir, "cpu", 0), new_runner(model_dir, "cpu", 8)
    sentinel_kv = [c.clone() for c in static.kv.caches]
    sentinel_temporal = static.state.temporal.clone()
    ref, steps = run_schedule(eager)
    ours, _ = run_schedule(static, ref)
    for a, b in zip(ours, ref):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        assert_near(a, b)
    assert sorted(static.decode_graphs.widths_run) == [256, 512]  # the fixed-shape path ran

    used_slots = sorted({s.state_slot for step in steps for s in step})
    assert_near(static.state.temporal[:, used_slots], eager.state.temporal[:, used_slots])
    assert_near(static.state.conv[:, used_slots], eager.state.conv[:, used_slots])
    unused_slots = [i for i in range(1, 12) if i not in used_slots]
    assert torch.equal(static.state.temporal[:, unused_slots],
                       sentinel_temporal[:, unused_slots])
    used_rows = torch.cat([torch.tensor([p * PAGE + o for p in s.page_table for o in range(PAGE)])
                           [: s.prefix_len + 1] for step in steps for s in step]).unique()
    scratch = static.kv.scratch_row
    other = torch.ones(scratch, dtype=torch.bool)
    other[used_rows] = False
    for ours_kv, eager_kv, before in zip(static.kv.caches, eager.kv.caches, sentinel_kv):
        assert_near(ours_kv[used_rows], eager_kv[used_rows])
        assert torch.equal(ours_kv[:scratch][other], before[:scratch][other])
        assert not torch.equal(ours_kv[scratch], before[scratch])  # padding wrote only here


def test_slot_row_tables_follow_new_occupants_and_moved_rows():
    """The fixed-shape path keeps each slot's KV rows on the device and writes only what
    changed.  One slot serves request A, then request B (a fresh prefill); then B's KV moves to
    other pages and arrives as a new table (as when the radix tree swaps rows), and the old pages
    are overwritten.  Every decode step must still equal the eager decode's: a stale row table
    would read A's rows or B's old pages."""
    static, eager = new_runner(KIMI, "cpu", 4), new_runner(KIMI, "cpu", 0)

    def decode(seq: SeqInput, steps: int) -> None:
        for _ in range(steps):
            ours, ref = static.forward([seq]), eager.forward([seq])
            assert_near(ours, ref)
            seq.prefix_len += len(seq.token_ids)
            seq.token_ids = [int(ref.argmax(-1))]

    a = SeqInput(list(range(3, 40)), 0, list(range(0, 12)), 2)
    decode(a, 4)
    b = SeqInput(list(range(50, 70)), 0, list(range(20, 28)), 2)
    decode(b, 4)
    moved = list(range(40, 48))
    old_rows = torch.tensor([p * PAGE + o for p in b.page_table for o in range(PAGE)])
    new_rows = torch.tensor([p * PAGE + o for p in moved for o in range(PAGE)])
    for runner in (static, eager):
        for cache in runner.kv.caches:
            cache[new_rows] = cache[old_rows]
            cache[old_rows] = torch.randn(cache[old_rows].shape)
    b.page_table = moved
    decode(b, 3)
    assert static.decode_graphs.widths_run == {256}


def test_static_decode_rejects_bad_steps_before_touching_state():
    runner = new_runner(KIMI, "cpu", 4)
    before = runner.state.temporal.clone()
    with pytest.raises(ValueError, match="same KV row"):
        runner.forward([SeqInput([5], 3, [0], 1), SeqInput([6], 3, [0], 2)])
    with pytest.raises(ValueError, match="page table covers"):
        runner.forward([SeqInput([5], 4, [0], 1)])
    assert torch.equal(runner.state.temporal, before)


@pytest.mark.parametrize("name", ["kda-odd-heads-qlora", "gdn-gva2-mixed-mlp"])
def test_static_decode_matches_transformers(name, tmp_path):
    """Grouped expert routing, q-LoRA MLA, GVA, a dense layer among MoE ones: single-sequence
    decode (batch 1) and the 3-prompt batch (padded to 4) against transformers."""
    arch, overrides = CONFIGS[name]
    hf = make_model(arch, tmp_path, seed=len(name), **overrides)
    runner = make_runner(str(tmp_path), cuda_graph_max_bs=4)
    ps = prompts(hf.config.vocab_size)
    check_against_reference(hf, ps, STEPS, run_scenarios(runner, ps, STEPS))
    assert runner.decode_graphs.widths_run, "the fixed-shape path never ran"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["kimi-tiny", "qwen3-next-tiny"])
def test_cuda_graph_replay_equals_eager_decode(model):
    model_dir = {"kimi-tiny": KIMI, "qwen3-next-tiny": QWEN}[model]
    eager, graphed = new_runner(model_dir, "cuda", 0), new_runner(model_dir, "cuda", 8)
    assert sorted(graphed.decode_graphs.graphs) == [(bs, w) for bs in (1, 2, 4, 8)
                                                     for w in (256, 512)]  # all at start-up
    ref, _ = run_schedule(eager)
    ours, _ = run_schedule(graphed)  # greedy on its own tokens: token for token
    for a, b in zip(ours, ref):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        assert_near(a, b, rel=1e-4)
