"""Per-step cost of structured output in rank 0's sampler: ``sample_tokens`` over a batch of
random logits with every row under a JSON-schema grammar, against the same batch without one.

    OMP_NUM_THREADS=1 python -m model_runner.bench.grammar_mask [--batch 1 8 32] [--steps 64]
        [--bpe-vocab 32000]

Two tokenizers: the built-in byte tokenizer (264 ids) and a byte-level BPE trained here on the
repository's own text to ``--bpe-vocab`` ids (a real model's vocabulary size class; 0 skips it).
A step samples one token per row and feeds it to the row's matcher; rows restart their grammar
when their JSON is complete.  Prints one JSON line per (tokenizer, batch) and a markdown
table: median ms of ``sample_tokens`` per step with and without the grammar (mask, sampling,
matcher update) over steps where every row is mid-output, the difference per row, the median
step in which some row samples its first token (the matcher's first mask is the dear one), and
the mean ms to build a request's matcher (once, before its first token; timed apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dasc_server.requests import json_schema_grammar
from model_runner.grammar import TokenizerCache
from model_runner.sampling import LogitControlTable, sample_tokens
from scheduler.wire.rank_messages import LogitControls, Sample

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "model_runner" / "assets" / "kimi-linear-tiny"
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {
                             "city": {"type": "string"}, "zip": {"type": "string"}}}}}


def bpe_tokenizer_dir(vocab_size: int, out: Path) -> Path:
    """A byte-level BPE with ``vocab_size`` ids trained on the repository's .py/.md files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [str(p) for p in ROOT.rglob("*") if p.suffix in (".py", ".md")
             and ".venv" not in p.parts and p.stat().st_size < 1 << 20]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)
    return out


def one_run(cache: TokenizerCache, vocab: int, batch: int, steps: int, grammar: str) -> dict:
    """Median ms of ``sample_tokens`` per step (mask, sampling, matcher update) over steps
    where every row is mid-output, the median over steps where some row samples its first
    token (its matcher's first mask), and mean ms to build a request's matcher (``for_batch``
    at its first token, timed apart)."""
    table = LogitControlTable(cache)
    tokenizer = cache()
    rids = [f"r{i}" for i in range(batch)]
    index = dict.fromkeys(rids, 0)
    gen = torch.Generator().manual_seed(0)
    times, firsts, builds = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        specs, num_new = [], 0
        for rid in rids:
            is_new = bool(grammar) and index[rid] == 0
            num_new += is_new
            c = LogitControls({}, 0.0, 0.0, 1.0, 0, [], [], grammar) if is_new else None
            specs.append(Sample(1.0, 1.0, 0, 7, index[rid], c))
        started = time.perf_counter()
        controls = table.for_batch(rids, specs, logits)
        if num_new:
            builds.append((time.perf_counter() - started) / num_new)
        started = time.perf_counter()
        tokens = sample_tokens(logits, specs, controls).token_ids
        (firsts if num_new else times).append(time.perf_counter() - started)
        for rid, token, ctl in zip(rids, tokens, controls or [None] * batch):
            index[rid] += 1
            if ctl is not None and (token == tokenizer.eos_token
                                    or ctl.matcher.matcher.is_stopped()):
                table.release([rid])  # JSON complete: the row starts the next one
                index[rid] = 0
    return {"median_ms": statistics.median(times) * 1e3,
            "first_ms": statistics.median(firsts) * 1e3 if firsts else 0.0,
            "build_ms": statistics.mean(builds) * 1e3 if builds else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--bpe-vocab", type=int, default=32000)
    args = ap.parse_args()
    tokenizers = [("byte", KIMI, 264, 258)]
    tmp = tempfile.TemporaryDirectory()
    if args.bpe_vocab:
        folder = bpe_tokenizer_dir(args.bpe_vocab, Path(tmp.name) / "bpe")
        tokenizers.append((f"bpe-{args.bpe_vocab}", folder, args.bpe_vocab, 0))
    grammar = json_schema_grammar(SCHEMA)
    rows = []
    for name, folder, vocab, eos in tokenizers:
        cache = TokenizerCache(folder, vocab, eos)
        started = time.perf_counter()
        cache()
        build_ms = (time.perf_counter() - started) * 1e3
        for batch in args.batch:
            plain = one_run(cache, vocab, batch, args.steps, "")
            masked = one_run(cache, vocab, batch, args.steps, grammar)
            row = {"tokenizer": name, "vocab": vocab, "batch": batch,
                   "tokenizer_build_ms": round(build_ms, 1),
                   "plain_ms": round(plain["median_ms"], 3),
                   "grammar_ms": round(masked["median_ms"], 3),
                   "extra_ms_per_row": round((masked["median_ms"] - plain["median_ms"])
                                             / batch, 3),
                   "first_token_step_ms": round(masked["first_ms"], 3),
                   "matcher_build_ms": round(masked["build_ms"], 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| tokenizer | vocab | batch | step ms, no grammar | step ms, grammar | "
          "extra ms per row | step ms with a first token | matcher build ms |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['vocab']} | {r['batch']} | {r['plain_ms']} | "
              f"{r['grammar_ms']} | {r['extra_ms_per_row']} | {r['first_token_step_ms']} | "
              f"{r['matcher_build_ms']} |")


if __name__ == "__main__":
    main()
