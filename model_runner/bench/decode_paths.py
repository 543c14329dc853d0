"""Eager decode step vs the fixed-shape step a CUDA graph replays, interleaved in one process;
or (``--mla``) absorbed vs expanded MLA decode on one runner, alternating step by step.

    python -m model_runner.bench.decode_paths --model DIR [--dtype float32] [--decode-batch 1 4]
        [--context 64] [--decode-steps 16] [--mla [--cuda-graph]]

Two runners on the same weights (one with ``cuda_graph_max_bs``), the same sequences; their
decode steps alternate, so load from other processes hits both alike (on a shared machine two
separate ``model_runner.bench.runner_speed`` runs differ by up to 2x from one minute to the next).
Prints one JSON line per batch size: the median step of each path and their ratio.  On CPU the
fixed-shape step runs eagerly (what ``model_runner.bench.runner_speed --cuda-graph``
measures).  With
``--mla`` (Kimi-Linear) one runner (fixed-shape with ``--cuda-graph``, else eager) alternates
``MLAttention.absorb_decode`` between steps: "eager" is then the expanded form.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model_runner.batch import SeqInput
from model_runner.models.kimi_linear import MLAttention
from model_runner.runner import ModelRunner, RunnerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=64, help="prompt tokens before decoding")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--mla", action="store_true", help="absorbed vs expanded MLA decode")
    p.add_argument("--cuda-graph", action="store_true", help="with --mla: the fixed-shape step")
    a = p.parse_args()
    page, max_batch = 16, max(a.decode_batch)
    per_seq = -(-(a.context + a.decode_steps + 1) // page)
    paths = [("eager", 0), ("fixed_shape", max_batch)]
    if a.mla:
        paths = [("expanded", max_batch if a.cuda_graph else 0)]
    runners = {
        name: ModelRunner(RunnerConfig(a.model, dtype=a.dtype, device=a.device,
                                       num_pages=per_seq * max_batch, page_size=page,
                                       num_state_slots=max_batch + 1, cuda_graph_max_bs=bs))
        for name, bs in paths}
    if a.mla:  # the same runner, the same sequences: steps alternate the MLA form
        runners["absorbed"] = runners["expanded"]
    prompt = torch.randint(0, next(iter(runners.values())).vocab_size, (a.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    print(json.dumps({"model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "context": a.context}), flush=True)
    for batch in a.decode_batch:
        seqs = {name: [SeqInput(prompt, 0, list(range(i * per_seq, (i + 1) * per_seq)), i + 1)
                       for i in range(batch)] for name in runners}
        if a.mla:
            seqs["absorbed"] = seqs["expanded"]
        for name, runner in runners.items():
            if name != "absorbed":
                runner.forward(seqs[name])
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(a.decode_steps):
            for name, runner in runners.items():
                for m in runner.model.modules():
                    if isinstance(m, MLAttention):
                        m.absorb_decode = name != "expanded"
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
        (base, base_ms), (new, new_ms) = ms.items()
        print(json.dumps({"batch": batch, f"{base}_ms": round(base_ms, 2),
                          f"{new}_ms": round(new_ms, 2), "ratio": round(new_ms / base_ms, 3)}),
              flush=True)


if __name__ == "__main__":
    main()
