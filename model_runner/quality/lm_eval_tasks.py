"""Write two lm-eval tasks over local JSONL that the built-in tiny models can solve: needle
retrieval as ``generate_until`` (exact match of the value) and as ``multiple_choice`` (the value
among three other numbers, by loglikelihood).

    python -m model_runner.quality.lm_eval_tasks [--out docs/results/lm-eval/tasks] [--docs 40]
        [--length 512]

Then, against a running dasc-serve (see docs/results/lm-eval/README.md for the whole command):

    lm_eval --model local-completions --include_path OUT --tasks dasc_needle_gen,dasc_needle_mc \
        --model_args model=kimi-linear-tiny,base_url=http://127.0.0.1:8000/v1/completions,...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from model_runner.quality.tasks.retrieval import gen_s1
from model_runner.quality.tasks.text import random_number

GEN_YAML = """task: dasc_needle_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""

MC_YAML = """task: dasc_needle_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results/lm-eval/tasks", help="folder for the files")
    p.add_argument("--docs", type=int, default=40, help="documents per task")
    p.add_argument("--length", type=int, default=512, help="context length in bytes")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.docs):
        context, question, (value,) = gen_s1(rng, args.length)
        used = {value}
        choices = [" " + value] + [" " + random_number(rng, used) for _ in range(3)]
        rng.shuffle(choices)
        rows.append({"context": context + question, "answer": value, "choices": choices,
                     "label": choices.index(" " + value)})
    data = out / "needle.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "dasc_needle_gen.yaml").write_text(GEN_YAML.format(data=data))
    (out / "dasc_needle_mc.yaml").write_text(MC_YAML.format(data=data))
    print(f"wrote {data} and two task files in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
