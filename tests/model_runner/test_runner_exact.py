"""The runner at TP=1 against transformers on tiny random models of both architectures."""

from __future__ import annotations

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import (
    CONFIGS,
    STEPS,
    check_against_reference,
    make_runner,
    prompts,
    reference_logits,
    run_scenarios,
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_runner_matches_transformers(name, tmp_path):
    arch, overrides = CONFIGS[name]
    hf = make_model(arch, tmp_path, seed=len(name), **overrides)
    runner = make_runner(str(tmp_path))
    ps = prompts(hf.config.get_text_config().vocab_size)
    res = run_scenarios(runner, ps, STEPS)
    check_against_reference(hf, ps, STEPS, res)


def test_fresh_request_ignores_stale_slot_state(tmp_path):
    """A slot reused for a new request (prefix_len 0) must not leak the previous state."""
    from model_runner.batch import SeqInput

    make_model("kda", tmp_path)
    runner = make_runner(str(tmp_path))
    p = prompts(96, (12,))[0]
    first = runner.forward([SeqInput(p, 0, [0, 1, 2], 1)])
    runner.state.temporal[:, 1].normal_()
    runner.state.conv[:, 1].normal_()
    assert torch.equal(runner.forward([SeqInput(p, 0, [3, 4, 5], 1)]), first)


def test_state_api_zero_and_bad_slot(tmp_path):
    from model_runner.batch import SeqInput

    make_model("gdn", tmp_path)
    runner = make_runner(str(tmp_path))
    runner.forward([SeqInput(prompts(96, (9,))[0], 0, [0, 1, 2], 4)])
    state = runner.read_state(4)
    assert state.temporal.abs().sum() > 0 and state.conv.abs().sum() > 0
    conv, temporal = state.layer(0)
    assert temporal.shape == (4, 16, 16) and conv.shape[-1] == 3  # kernel - 1 positions
    runner.zero_state(4)
    assert runner.read_state(4).temporal.abs().sum() == 0
    with pytest.raises(IndexError):
        runner.read_state(0)  # reserved
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.forward([SeqInput([5, 96], 0, [0], 1)])


def test_sharded_checkpoint_and_bf16(tmp_path):
    """A checkpoint split into several files with an index loads identically; bf16 loads too."""
    from model_runner.batch import SeqInput

    hf = make_model("gdn", tmp_path / "one")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    p = prompts(96, (21,))[0]
    outs = {}
    for name, dtype in (("one", "float32"), ("sharded", "float32"), ("sharded", "bfloat16")):
        from model_runner.runner import ModelRunner, RunnerConfig

        runner = ModelRunner(RunnerConfig(str(tmp_path / name), dtype=dtype, num_pages=8,
                                          page_size=4, num_state_slots=2))
        outs[name, dtype] = runner.forward([SeqInput(p, 0, list(range(6)), 1)], all_logits=True)
    assert torch.equal(outs["one", "float32"], outs["sharded", "float32"])
    # bf16 against transformers in bf16: a few bf16 ulps at the logit scale
    ref = reference_logits(hf.to(torch.bfloat16), p)
    bf16 = outs["sharded", "bfloat16"]
    assert bf16.dtype == torch.float32 and (bf16 - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("arch", ["qwen3_5_moe_vl", "olmo_hybrid"])
def test_bf16_within_bf16_rounding_of_transformers(arch, tmp_path):
    """bf16 weights and activations against transformers in bf16: the two round at different
    points (fused projections, FP32 recurrences), so the logits agree to a few bf16 steps at
    the logit scale (5 %, as for Qwen3-Next); a random tiny model's top logits lie closer than
    that, so its greedy token may differ."""
    from model_runner.batch import SeqInput
    from model_runner.runner import ModelRunner, RunnerConfig

    hf = make_model(arch, tmp_path)
    p = prompts(96, (21,))[0]
    runner = ModelRunner(RunnerConfig(str(tmp_path), dtype="bfloat16", num_pages=8,
                                      page_size=4, num_state_slots=2))
    ours = runner.forward([SeqInput(p, 0, list(range(6)), 1)], all_logits=True)
    ref = reference_logits(hf.to(torch.bfloat16), p)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


def test_bad_steps_are_rejected_before_touching_state(tmp_path):
    from model_runner.batch import SeqInput

    make_model("kda", tmp_path)
    runner = make_runner(str(tmp_path))
    before = runner.state.temporal.clone()
    bad_steps = {
        "share a state slot": [SeqInput([5, 6], 0, [0], 1), SeqInput([7], 0, [1], 1)],
        "same KV row": [SeqInput([5, 6], 0, [0], 1), SeqInput([7], 0, [0], 2)],
        r"page id 10000 outside the KV pool \[0, 256\)": [SeqInput([5], 0, [10_000], 1)],
        "page id -1 outside": [SeqInput([5], 0, [0, -1], 1)],
        "state slot 0": [SeqInput([5], 0, [0], 0)],
        "negative prefix length": [SeqInput([5], -1, [0], 1)],
        "outside the vocabulary": [SeqInput([5, 96], 0, [0], 1)],
    }
    for message, seqs in bad_steps.items():
        with pytest.raises(ValueError, match=message):
            runner.forward(seqs)
    assert torch.equal(runner.state.temporal, before)


def test_serving_rank_checks_a_row_table_when_it_arrives(tmp_path):
    """A rank checks a request's row table once, when the plan that carries it arrives (a plan
    with no step for the request included), so its steps skip the O(context) table scan; they
    still sample what ``forward`` computes."""
    from model_runner.batch import SeqInput
    from model_runner.runner import ModelRunner, RunnerConfig
    from model_runner.serve_rank import execute, row_tables
    from scheduler.wire.rank_messages import BatchPlan, Sample, SeqStep

    def greedy(index: int) -> Sample:
        return Sample(temperature=0.0, top_p=1.0, top_k=0, seed=0, index=index)

    make_model("gdn", tmp_path)
    runner = ModelRunner(RunnerConfig(str(tmp_path), num_pages=32, page_size=1,
                                      num_state_slots=4))
    tables = row_tables(runner)
    bad_tables = {"page id 32 outside the KV pool": [3, 32], "page id -1 outside": [-1, 0],
                  "list of page ids": [[0, 1]]}
    for message, rows in bad_tables.items():
        with pytest.raises(ValueError, match=message):
            execute(runner, BatchPlan(1, tables={"a": rows}), tables)
        assert len(tables) == 0
    p = prompts(96, (9,))[0]
    rows = list(range(31, 21, -1))  # 9 prompt rows, 1 decode row
    tokens, _ = execute(runner, BatchPlan(2, tables={"a": rows},
                                          seqs=[SeqStep("a", p, 0, 1, greedy(0))]), tables)
    assert torch.equal(tables.rows("a"), torch.tensor(rows))
    expect = runner.forward([SeqInput(p, 0, list(range(9)), 2)]).argmax(-1).tolist()
    assert tokens == expect
    step = BatchPlan(3, seqs=[SeqStep("a", tokens, 9, 1, greedy(1))])  # names only its rid
    decoded, _ = execute(runner, step, tables)
    expect = runner.forward([SeqInput(tokens, 9, list(range(10)), 2)]).argmax(-1).tolist()
    assert decoded == expect


def test_logits_of_the_sampled_sequences_only(tmp_path):
    """``logits_of``: the rows of the listed sequences, those of the full step to FP32 rounding
    (the same hidden states; the LM head's GEMM may order a sum differently for another number
    of rows, as for another decode batch), and none at all for a step whose chunks nobody
    samples, whose states still advance bit for bit as in the full step."""
    from model_runner.batch import SeqInput

    make_model("gdn", tmp_path)
    runner = make_runner(str(tmp_path))
    a, b, c = prompts(96, (9, 7, 5))

    def step(slot0: int, **kw):
        return runner.forward([SeqInput(a, 0, [0, 1, 2], slot0), SeqInput(b, 0, [3, 4, 5],
                                                                           slot0 + 1),
                               SeqInput(c, 0, [6, 7], slot0 + 2)], **kw)

    full = step(1)
    for rows in ([0, 2], [1], [1, 2]):
        got = step(1, logits_of=rows)
        assert got.shape == (len(rows), full.shape[1])
        torch.testing.assert_close(got, full[rows], rtol=1e-5, atol=1e-5 * full.abs().max())
    assert torch.equal(step(1, logits_of=[0, 1, 2]), full)
    none = step(4, logits_of=[])
    assert none.shape == (0, full.shape[1])
    for slot in (1, 2, 3):
        assert torch.equal(runner.read_state(slot + 3).temporal, runner.read_state(slot).temporal)
