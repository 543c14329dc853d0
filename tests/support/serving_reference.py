"""What a served answer must equal, computed in process without a server: the offline engine's
greedy tokens (``Reference``, no cache) and the offline ``dasc-eval`` arm (``offline_arm``,
compressed checkpoint stored and loaded), and the prompts the exactness tests send."""

from __future__ import annotations

import torch

from model_runner.batch import SeqInput
from model_runner.engine import OfflineEngine
from model_runner.quality.arms import apply_arm, prepare_arm
from model_runner.runner import ModelRunner, RunnerConfig
from support.serving import ids

MAX_TOKENS = 6  # greedy tokens a Reference computes per prompt
NUM_TOKENS = 8  # greedy tokens offline_arm decodes by default
NEEDLE = ("The grass is green. kqzvb: 48213. The sky is blue. mdrte: 90318. Here we go.\n"
          "value of {key}:")
SHARED = "Facts to remember. " * 4  # 76 bytes: crosses two checkpoint intervals of 32
PROMPT_A = ids(NEEDLE.format(key="kqzvb"))
PROMPT_B = ids(NEEDLE.format(key="mdrte") + " and more")
FAMILY = [ids(SHARED + tail) for tail in ("sky?", "grass is", "the answer to life", "z")]


class Reference:
    """Greedy tokens of the offline engine, one fresh computation per prompt (no cache)."""

    def __init__(self, model_dir):
        rc = RunnerConfig(str(model_dir), num_pages=64, page_size=16, num_state_slots=2)
        self.engine = OfflineEngine(ModelRunner(rc))
        self.memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.memo:
            self.memo[key] = self.engine.generate([prompt], MAX_TOKENS)[0]
        return self.memo[key]


def offline_arm(model_dir, arm: str, context: list[int], question: list[int],
                num_tokens: int = NUM_TOKENS) -> tuple[list[int], list[float]]:
    """What ``dasc-eval`` computes for one instance: prefill the context, apply the arm's
    store/load (and refresh), prefill the question, decode greedily; tokens and logprobs."""
    rc = RunnerConfig(str(model_dir), num_pages=64, page_size=16, num_state_slots=3)
    runner = ModelRunner(rc)
    prepare_arm(runner, arm, batch=1)
    seq = SeqInput(context, 0, list(range(64)), 1)
    runner.forward([seq])
    seq.prefix_len, seq.token_ids = len(context), question
    apply_arm(runner, [seq], arm, [context])
    tokens, logprobs = [], []
    for _ in range(num_tokens):
        logp = torch.log_softmax(runner.forward([seq])[0].float(), dim=-1)
        tokens.append(int(logp.argmax()))
        logprobs.append(float(logp[tokens[-1]]))
        seq.prefix_len, seq.token_ids = seq.prefix_len + len(seq.token_ids), tokens[-1:]
    return tokens, logprobs
