"""Structured output in rank 0's sampler (model_runner/grammar.py, model_runner/sampling.py):
over random logits, a request with a JSON-schema grammar only ever samples tokens that keep its
output a prefix of valid JSON, ends with EOS exactly when the JSON is complete, and samples the
same tokens whatever shares its batch.  The built-in byte tokenizer (id == byte, EOS 258)."""

from __future__ import annotations

import json

import pytest
import torch
from support.serving import KIMI

from dasc_server.requests import json_schema_grammar, response_format_grammar
from model_runner.byte_tokenizer import EOS_ID, MODEL_VOCAB_SIZE, NUM_BYTES
from model_runner.grammar import TokenizerCache
from model_runner.sampling import LogitControlTable, sample_tokens
from scheduler.wire.rank_messages import LogitControls, Sample

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n", "tag"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 4}}}
TOKENIZER = TokenizerCache(KIMI, MODEL_VOCAB_SIZE, EOS_ID)


def grammar_controls(grammar: str, min_tokens: int = 0, bias: dict | None = None
                     ) -> LogitControls:
    return LogitControls(dict(bias or {}), 0.0, 0.0, 1.0, min_tokens,
                         [EOS_ID] if min_tokens else [], [], grammar)


def logits_for(seed: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + step)
    x = torch.randn(1, MODEL_VOCAB_SIZE, generator=gen) * 4
    x[0, EOS_ID] -= 6  # the model would rather go on: the grammar has to end it
    return x


def run(rows: dict[str, tuple[LogitControls | None, float]], steps: int = 120
        ) -> dict[str, list[int]]:
    """Sample ``steps`` tokens for every row in one batch (rows leave after EOS)."""
    table, out = LogitControlTable(TOKENIZER), {rid: [] for rid in rows}
    seed_of = {rid: sum(map(ord, rid)) for rid in rows}  # by name: the same in any batch
    for step in range(steps):
        live = [rid for rid in rows if EOS_ID not in out[rid]]
        if not live:
            break
        specs = [Sample(rows[rid][1], 1.0, 0, seed_of[rid], step,
                        rows[rid][0] if step == 0 else None) for rid in live]
        logits = torch.cat([logits_for(seed_of[rid], step) for rid in live])
        tokens, *_ = sample_tokens(logits, specs, table.for_batch(live, specs, logits))
        for rid, token in zip(live, tokens):
            out[rid].append(token)
    return out


def text(tokens: list[int]) -> str:
    assert tokens[-1] == EOS_ID and all(t < NUM_BYTES for t in tokens[:-1])
    return bytes(tokens[:-1]).decode()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_schema_output_is_valid_and_ends_with_eos(temperature):
    c = grammar_controls(json_schema_grammar(SCHEMA))
    for rid in ("a", "b", "c"):
        got = json.loads(text(run({rid: (c, temperature)})[rid]))
        assert set(got) == {"color", "n", "tag"} and got["color"] in ("red", "green", "blue")
        assert 0 <= got["n"] <= 99 and isinstance(got["tag"], str) and len(got["tag"]) <= 4


def test_json_object_is_an_object():
    c = grammar_controls(response_format_grammar({"type": "json_object"}))
    out = run({"x": (c, 0.7)}, steps=400)["x"]
    if out[-1] == EOS_ID:  # random logits may well write a long object; any end is valid
        assert isinstance(json.loads(text(out)), dict)
    else:
        assert bytes(out[:1]) == b"{"


def test_a_rows_tokens_do_not_depend_on_its_batch():
    schema = grammar_controls(json_schema_grammar(SCHEMA))
    other = grammar_controls(json_schema_grammar({"type": "array", "items": {"type": "integer"}}))
    alone = run({"a": (schema, 1.0)})
    plain_alone = run({"p": (None, 1.0)}, steps=30)
    together = run({"p": (None, 1.0), "z": (other, 0.5), "a": (schema, 1.0)})
    assert together["a"] == alone["a"]
    assert together["p"][:30] == plain_alone["p"]


def test_grammar_wins_over_min_tokens_and_bias():
    """min_tokens bans EOS and a bias pushes a byte the grammar forbids: the output is still
    the grammar's (EOS once the JSON is complete)."""
    grammar = json_schema_grammar({"enum": ["ok"]})
    c = grammar_controls(grammar, min_tokens=20, bias={ord("x"): 100.0})
    out = run({"a": (c, 0.0)})["a"]
    assert text(out) == '"ok"'


def test_a_grammar_rank_0_cannot_build_ends_the_request_not_the_rank(tmp_path, capfd):
    """No tokenizer in the model folder: the request ends with EOS at once, the error goes to
    stderr, and the other rows of the batch sample as before."""
    table = LogitControlTable(TokenizerCache(tmp_path, MODEL_VOCAB_SIZE, EOS_ID))
    specs = [Sample(1.0, 1.0, 0, 3, 0, grammar_controls(json_schema_grammar(SCHEMA))),
             Sample(1.0, 1.0, 0, 4, 0)]
    logits = torch.cat([logits_for(1, 0), logits_for(2, 0)])
    tokens, *_ = sample_tokens(logits, specs, table.for_batch(["bad", "ok"], specs, logits))
    assert tokens[0] == EOS_ID and "dasc grammar error" in capfd.readouterr().err
    assert tokens[1] == sample_tokens(logits[1:], specs[1:]).token_ids[0]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A Hugging Face fast tokenizer whose tokens span several bytes (a byte-level BPE
    trained on JSON-like text), as real models' are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"color": c, "n": n, "tag": t}) for c in ("red", "green", "blue")
              for n in range(0, 100, 7) for t in ("ab", "tag", "x y")] * 3
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return folder


def test_a_multi_byte_tokenizer_gives_valid_json_too(bpe_folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bpe_folder)
    vocab, eos = 416, hf.eos_token_id  # logits wider than the tokenizer, as models pad them
    table = LogitControlTable(TokenizerCache(bpe_folder, vocab, eos))
    c = grammar_controls(json_schema_grammar(SCHEMA))
    for seed in range(3):
        out = []
        for step in range(120):
            gen = torch.Generator().manual_seed(seed * 1000 + step)
            logits = torch.randn(1, vocab, generator=gen) * 4
            spec = [Sample(1.0, 1.0, 0, seed, step, c if step == 0 else None)]
            token = sample_tokens(logits, spec, table.for_batch([f"r{seed}"], spec,
                                                                logits)).token_ids[0]
            out.append(token)
            if token == eos:
                break
        assert out[-1] == eos and all(t < len(hf) for t in out)
        assert max(len(hf.decode([t])) for t in out[:-1]) > 1  # multi-byte tokens were used
        got = json.loads(hf.decode(out[:-1]))
        assert got["color"] in ("red", "green", "blue") and 0 <= got["n"] <= 99
