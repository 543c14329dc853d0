"""One prefill step of cache hits: B sequences each bring N new tokens after P cached ones (a
chat turn or an agent's request past its shared prompt), the prefill attention's AMX form
(``kernels/prefill_attention``) and torch's alternating in one process, so drift hits both
alike.  One rank.

    python -m model_runner.bench.hit_step --model DIR [--seqs 4] [--prefix 2099] [--new 101]
        [--reps 6]

Each repetition runs the same step from the same KV rows; the linear layers' states are not
restored between repetitions (their cost does not depend on their values).  Prints one JSON
line: the medians with the AMX form off and on, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels import prefill_attention
from model_runner.batch import SeqInput
from model_runner.config import DEFAULT_MODEL
from model_runner.parallel import init_tp_group, rank_device, shutdown_tp_group
from model_runner.runner import ModelRunner, RunnerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seqs", type=int, default=4, help="sequences in the step (default: 4)")
    p.add_argument("--prefix", type=int, default=2099, help="cached tokens each (default: 2099)")
    p.add_argument("--new", type=int, default=101, help="new tokens each (default: 101)")
    p.add_argument("--reps", type=int, default=6, help="steps per form (default: 6)")
    args = p.parse_args()
    if min(args.seqs, args.prefix, args.new, args.reps) < 1:
        p.error("--seqs, --prefix, --new and --reps must be at least 1")
    tp = init_tp_group(rank_device("cpu"))
    per_seq = args.prefix + args.new
    runner = ModelRunner(RunnerConfig(args.model, dtype=args.dtype, device="cpu",
                                      num_pages=per_seq * args.seqs, page_size=1,
                                      num_state_slots=args.seqs + 1), tp)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.seqs)]
    for i, table in enumerate(tables):
        prompt = torch.randint(0, runner.vocab_size, (args.prefix,), generator=gen).tolist()
        runner.forward([SeqInput(prompt, 0, table, i + 1)])
    new = [torch.randint(0, runner.vocab_size, (args.new,), generator=gen).tolist()
           for _ in tables]
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.reps):
        for on in (False, True):
            prefill_attention.set_amx(on)
            step = [SeqInput(ids, args.prefix, table, i + 1)
                    for i, (ids, table) in enumerate(zip(new, tables))]
            start = time.perf_counter()
            runner.forward(step)
            times[on].append(time.perf_counter() - start)
    prefill_attention.set_amx(True)
    off, on = (1000 * statistics.median(times[x]) for x in (False, True))
    print(json.dumps({"seqs": args.seqs, "prefix": args.prefix, "new": args.new,
                      "attention_amx": prefill_attention.amx_available(),
                      "step_ms_amx_off": round(off, 1), "step_ms": round(on, 1),
                      "ratio": round(on / off, 3)}), flush=True)
    shutdown_tp_group(tp)


if __name__ == "__main__":
    main()
