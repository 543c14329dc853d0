"""Scenarios run by the model runner (in-process or on every torchrun rank) and their checks
against transformers, the tiny random model configurations they run on and their prompts.
Results are plain dicts of tensors so ranks can save them to disk."""

from __future__ import annotations

import torch

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig

PAGE = 4  # small pages so sequences span several, in scattered order
STEPS = 16  # greedy decode steps of a scenario
# (architecture, `random_checkpoints.make_model` overrides)
CONFIGS = {
    # KDA with odd head count, q-LoRA MLA, grouped expert routing, two dense-first layers
    "kda-odd-heads-qlora": ("kda", dict(linear_attn_config={"num_heads": 3}, q_lora_rank=24,
                                        num_local_experts=8, n_group=2, topk_group=1,
                                        first_k_dense_replace=2, num_attention_heads=3,
                                        num_key_value_heads=3)),
    "kda-moe": ("kda", dict(num_hidden_layers=5, full_attn_layers=[3])),
    # GDN with GVA ratio 2, a dense MLP layer among MoE layers, a single KV head
    "gdn-gva2-mixed-mlp": ("gdn", dict(mlp_only_layers=[1], num_key_value_heads=1)),
    "gdn-gva3-odd": ("gdn", dict(linear_num_key_heads=1, linear_num_value_heads=3,
                                 num_attention_heads=3, num_key_value_heads=3,
                                 num_hidden_layers=3, layer_types=["linear_attention",
                                 "full_attention", "linear_attention"])),
    # Qwen3.5: text-only and as shipped (vision tower, language model nested), dense and MoE
    # (fused experts on disk), GVA ratios 1, 2 and 3, tied embeddings
    "qwen3_5-gva1": ("qwen3_5", dict(linear_num_value_heads=2)),
    "qwen3_5-vl-gva3": ("qwen3_5_vl", dict(linear_num_key_heads=1, linear_num_value_heads=3,
                                           tie_word_embeddings=False)),
    "qwen3_5-moe-gva2": ("qwen3_5_moe", dict(num_key_value_heads=1)),
    "qwen3_5-moe-vl": ("qwen3_5_moe_vl", dict()),
    # OLMo-Hybrid: negative eigenvalues, post-norm attention, value heads wider than keys
    "olmo-hybrid-gva2": ("olmo_hybrid", dict()),
}


def snapshot_cuts(prompt: list[int]) -> list[int]:
    """Where a prompt's snapshots go: a third of the way in (an interior store point, so the
    rounds run segments of different sequences side by side) and before its last token."""
    return sorted({c for c in (len(prompt) // 3, len(prompt) - 1) if c >= 1})


def prompts(vocab: int, lengths=(37, 5, 20), seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class Pages:
    """Hands out pages in a scrambled order so page tables are never contiguous."""

    def __init__(self, num_pages: int):
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7)).tolist()

    def take(self, num_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-num_tokens // PAGE))]


def make_runner(model_dir: str, tp=None, head_order=None, cuda_graph_max_bs: int = 0,
                **config) -> ModelRunner:
    """A runner of the tiny model; ``config``: other ``RunnerConfig`` fields (dtype, ...)."""
    rc = RunnerConfig(model_dir, num_pages=256, page_size=PAGE, num_state_slots=12,
                      cuda_graph_max_bs=cuda_graph_max_bs, **config)
    return ModelRunner(rc, tp, head_order)


def greedy(runner: ModelRunner, seqs: list[SeqInput], steps: int):
    """Prefill ``seqs`` together, then ``steps - 1`` batched decode steps; returns
    (tokens [B, steps], per-step logits [steps, B, vocab])."""
    logits = [runner.forward(seqs)]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps - 1):
        for s, t in zip(seqs, tokens[-1].tolist()):
            s.prefix_len += len(s.token_ids)
            s.token_ids = [t]
        logits.append(runner.forward(seqs))
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1), torch.stack(logits)


def run_scenarios(runner: ModelRunner, prompts: list[list[int]], steps: int) -> dict:
    pages = Pages(runner.rc.num_pages)
    out: dict = {"prefill": [], "tokens": [], "decode_logits": []}
    for p in prompts:  # one by one: all-position prefill logits, then greedy decode
        out["prefill"].append(runner.forward([SeqInput(p, 0, pages.take(len(p)), 1)],
                                             all_logits=True))
        tokens, logits = greedy(runner, [SeqInput(p, 0, pages.take(len(p) + steps), 2)], steps)
        out["tokens"].append(tokens[0])
        out["decode_logits"].append(logits[:, 0])
    # all prompts in one batch (unequal lengths), scattered slots
    seqs = [SeqInput(p, 0, pages.take(len(p) + steps), 3 + 2 * i) for i, p in enumerate(prompts)]
    out["batch_tokens"], out["batch_logits"] = greedy(runner, seqs, steps)
    # state round trip: prefix P in slot 1, copy its state into slot 9, continue with suffix S
    p = prompts[0]
    cut = len(p) // 2
    table = pages.take(len(p))
    runner.forward([SeqInput(p[:cut], 0, table, 1)])
    runner.zero_state(9)
    runner.write_state(9, runner.read_state(1))
    runner.zero_state(1)  # the copy must not depend on the source slot any more
    out["roundtrip"] = runner.forward([SeqInput(p[cut:], cut, table, 9)], all_logits=True)
    out["roundtrip_cut"] = cut
    return out


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    bound = rtol * ref.abs().max().item()
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"


def check_against_reference(hf_model, prompts: list[list[int]], steps: int, res: dict) -> None:
    for i, p in enumerate(prompts):
        assert_rel_close(res["prefill"][i], reference_logits(hf_model, p))
        tokens = res["tokens"][i].tolist()
        full = reference_logits(hf_model, p + tokens)
        expected = full[len(p) - 1 : len(p) - 1 + steps]
        assert tokens == expected.argmax(-1).tolist(), "greedy tokens differ from transformers"
        assert_rel_close(res["decode_logits"][i], expected)
        # batched prefill + batched decode equal the one-by-one run
        assert res["batch_tokens"][i].tolist() == tokens
        assert_rel_close(res["batch_logits"][:, i], res["decode_logits"][i], rtol=1e-5)
    cut, p = res["roundtrip_cut"], prompts[0]
    assert_rel_close(res["roundtrip"], reference_logits(hf_model, p)[cut:])
