"""Eager decode step vs the fixed-shape step a CUDA graph replays, interleaved in one process.

    python bench/decode_paths.py --model DIR [--dtype float32] [--decode-batch 1 4]
                                 [--context 64] [--decode-steps 16]

Two runners on the same weights (one with ``cuda_graph_max_bs``), the same sequences; their
decode steps alternate, so load from other processes hits both alike (on a shared machine two
separate ``bench/runner_speed.py`` runs differ by up to 2x from one minute to the next).  Prints
one JSON line per batch size: the median step of each path and their ratio.  On CPU the
fixed-shape step runs eagerly (what ``bench/runner_speed.py --cuda-graph`` measures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model_runner.batch import SeqInput
from model_runner.runner import ModelRunner, RunnerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--decode-steps", type=int, default=16)
    a = p.parse_args()
    page, max_batch = 16, max(a.decode_batch)
    per_seq = -(-(a.context + a.decode_steps + 1) // page)
    runners = {
        name: ModelRunner(RunnerConfig(a.model, dtype=a.dtype, device=a.device,
                                       num_pages=per_seq * max_batch, page_size=page,
                                       num_state_slots=max_batch + 1, cuda_graph_max_bs=bs))
        for name, bs in (("eager", 0), ("fixed_shape", max_batch))}
    prompt = torch.randint(0, runners["eager"].vocab_size, (a.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    print(json.dumps({"model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "context": a.context}), flush=True)
    for batch in a.decode_batch:
        seqs = {name: [SeqInput(prompt, 0, list(range(i * per_seq, (i + 1) * per_seq)), i + 1)
                       for i in range(batch)] for name in runners}
        for name, runner in runners.items():
            runner.forward(seqs[name])
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(a.decode_steps):
            for name, runner in runners.items():
                for s in seqs[name]:
                    s.prefix_len += len(s.token_ids)
                    s.token_ids = [7]
                if a.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                runner.forward(seqs[name])
                if a.device == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        print(json.dumps({"batch": batch, "eager_ms": round(ms["eager"], 2),
                          "fixed_shape_ms": round(ms["fixed_shape"], 2),
                          "ratio": round(ms["fixed_shape"] / ms["eager"], 3)}), flush=True)


if __name__ == "__main__":
    main()
