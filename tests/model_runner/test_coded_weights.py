"""Coded weights (``--cpu-coded-weights``, ``kernels.gemv.CodedWeight``): a bf16 runner gives its
linears and MoE layers coded copies of their weights, its decode steps stream those, and its
tokens and logits have the same bits with and without them, through prefill and batched
decode.  Where a linear also holds a packed bf16 copy, the two copies run every row count
and it drops its weight."""

from __future__ import annotations

import json

import pytest
import torch
from support.paths import SUPPORT
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE, STEPS, greedy, prompts

import model_runner.layers.linear as linear_module
from kernels.gemv import CODE_BLOCK, code_weight, native_library, simd_available
from model_runner.batch import SeqInput
from model_runner.cpu_features import cpu_has_native_bf16
from model_runner.layers.linear import PackedGemm, linear, pack_weight
from model_runner.layers.mlp import SparseMoE
from model_runner.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(native_library() is None or not simd_available(),
                                reason="the coded GEMV needs a C compiler and AVX-512")


def bf16_runner(model_dir: str, coded: bool, screen: str = "auto",
                graphs: int = 0) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, dtype="bfloat16", num_pages=256, page_size=PAGE,
                                    num_state_slots=12, coded_weights=coded,
                                    lm_head_screen=screen, cuda_graph_max_bs=graphs))


def greedy_run(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts prefilled together, then batched greedy decode: (tokens, logits)."""
    seqs = [SeqInput(p, 0, list(range(i * 60, (i + 1) * 60)), i + 1)
            for i, p in enumerate(prompts(runner.vocab_size))]
    with torch.inference_mode():
        return greedy(runner, seqs, steps=6)


def assert_same_bits(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("arch", ["gdn", "qwen3_5"])
def test_the_same_bits_with_and_without_coded_copies(tmp_path, arch):
    make_model(arch, tmp_path)
    runs = {}
    for coded in (True, False):
        runner = bf16_runner(str(tmp_path), coded)
        linears = [m for m in runner.model.modules() if isinstance(m, PackedGemm)]
        # every bf16 weight whose rows are whole 64-element blocks, where decode runs its GEMV
        assert all((m.coded is not None) == (coded and m.weight.shape[1] % CODE_BLOCK == 0
                                             and m.decode_gemv) for m in linears)
        moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert all((m.coded is not None) == coded for m in moes)
        assert any(m.coded is not None for m in linears) == coded
        runs[coded] = greedy_run(runner)
    assert_same_bits(runs[True], runs[False])


def stands_in(m: PackedGemm) -> bool:
    """Whether a linear's copies run all its row counts (``PackedGemm.release_weight``)."""
    return (not m.keeps_weight and m.coded is not None and m.packed is not None
            and m.packed.dtype == torch.bfloat16)


@pytest.mark.parametrize("arch", ["gdn", "qwen3_5", "qwen3_5_moe", "kda", "olmo_hybrid"])
def test_linears_drop_the_weights_their_copies_stand_in_for(tmp_path, monkeypatch, arch):
    """Every linear packed (the tiny models' weights are below the size that packs): those
    with packed bf16 and coded copies drop their weights, the others (a tied head, a shared
    expert read input-major, MLA's absorbed projection) keep them, and the tokens and logits
    are those of a runner without coded copies, which keeps every weight.  A tied head's
    embedding and the greedy rows' screen read the head's rows from its coded copy."""
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)
    make_model(arch, tmp_path)
    runs, sizes = {}, {}
    for coded in (True, False):
        runner = bf16_runner(str(tmp_path), coded, screen="on")
        # what the weights take in every form, at least the model as loaded (the serving
        # rank's warm-up goes by it), with copies or without
        sizes[coded] = runner.weight_bytes, sum(p.nbytes for p in runner.model.parameters())
        linears = [m for m in runner.model.modules() if isinstance(m, PackedGemm)]
        assert all((m.weight is None) == (coded and stands_in(m)) for m in linears)
        assert any(m.weight is None for m in linears) == (coded and cpu_has_native_bf16())
        moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert all((m.w13 is None) == (coded and cpu_has_native_bf16()) for m in moes)
        head, embedding = runner.model.lm_head, runner.model.model.embed_tokens
        if runner.cfg.tie_word_embeddings:  # its rows from the head's copy where it drops it
            assert (embedding.weight is None) == (head.weight is None)
            assert embedding.coded is (head.coded if head.weight is None else None)
        else:  # from a copy of its own
            assert (embedding.weight is None) == coded == (embedding.coded is not None)
        runs[coded] = greedy_run(runner)
        if runner.screened_head is not None:
            fresh = [SeqInput(p, 0, list(range(180 + i * 20, 200 + i * 20)), 7 + i)
                     for i, p in enumerate(prompts(runner.vocab_size, seed=1))]
            with torch.inference_mode():
                hidden = runner.forward(fresh, head=False)
                want = runner.head_logits(hidden).argmax(dim=-1).tolist()
                assert runner.greedy(hidden) == want and runner.screened_tokens == len(want)
    assert_same_bits(runs[True], runs[False])
    assert sizes[True][0] > sizes[False][1] and sizes[False][0] > sizes[False][1]


def test_fixed_shape_decode_keeps_the_experts(tmp_path, monkeypatch):
    """Fixed-shape decode (``cuda_graph_max_bs``) reads the routed experts' weights: a runner
    with it keeps them beside their copies, and its tokens and logits keep their bits."""
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)
    make_model("gdn", tmp_path)
    runs = {}
    for coded in (True, False):
        runner = bf16_runner(str(tmp_path), coded, graphs=4)
        moes = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
        assert moes and all(m.w13 is not None and m.w2 is not None for m in moes)
        runs[coded] = greedy_run(runner)
    assert_same_bits(runs[True], runs[False])


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="packed bf16 copies need native bf16")
def test_a_released_weight_runs_from_its_copies(monkeypatch):
    """``linear`` without the weight: its coded copy takes 1-4 rows, the packed one more, with
    the bits of the weight's own forms; input the copies cannot take is refused."""
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=gen).bfloat16()
    packed, coded = pack_weight(weight), code_weight(weight)
    assert packed is not None and packed.dtype == torch.bfloat16 and coded is not None
    with torch.inference_mode():
        for rows in (1, 3, 4, 5, 17):
            x = torch.randn(rows, 128, generator=gen).bfloat16()
            assert torch.equal(linear(x, None, packed, coded), linear(x, weight, packed, coded))
            assert torch.equal(linear(x, None, packed, coded), linear(x, weight, packed))
        with pytest.raises(RuntimeError, match="bf16"):
            linear(x[:1].float(), None, packed, coded)  # only the plain weight took it


def test_tp2_the_same_bits_with_and_without_coded_copies(tmp_path, torchrun):
    """TP=2 over torchrun: each rank codes its shards (and, every linear packed, drops the
    weights its copies stand in for); every scenario's tokens and logits keep their bits."""
    jobs = []
    for i, arch in enumerate(("gdn", "qwen3_5")):
        hf = make_model(arch, tmp_path / arch, seed=i, linear_num_key_heads=4,
                        linear_num_value_heads=8)
        ps = prompts(hf.config.get_text_config().vocab_size, seed=i)
        jobs += [{"model_dir": str(tmp_path / arch), "prompts": ps, "steps": STEPS,
                  "pack_all": True, "config": {"dtype": "bfloat16", "coded_weights": coded}}
                 for coded in (True, False)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    torchrun(2, SUPPORT / "tp_worker.py", str(spec), str(tmp_path))
    for i in range(0, len(jobs), 2):
        coded, plain = (torch.load(tmp_path / f"job{j}.pt") for j in (i, i + 1))
        assert plain["released"] == 0 and (coded["released"] > 0) == cpu_has_native_bf16()
        for key in ("tokens", "prefill", "decode_logits"):
            assert all(torch.equal(a, b) for a, b in zip(coded[key], plain[key])), key
        for key in ("batch_tokens", "batch_logits", "roundtrip"):
            assert torch.equal(coded[key], plain[key]), key
