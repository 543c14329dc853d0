"""The loop behind ``dasc-eval``: every arm on the same instances, each context prefilled once.

Per batch of instances of one (task, length): prefill the contexts (the cacheable prefix) and
keep their dense states.  Then, the dense reference first and every arm after it: restore the
dense state, apply the arm (what a cache hit would restore), teacher-force the question and the
gold completion on top (fidelity against the dense reference's logits, computed once per
instance), and score greedy decoding after the question.  Greedy decoding is skipped for an
instance whose teacher-forced argmax path already is the gold completion (greedy decoding emits
exactly those tokens); ``decode_all`` decodes every instance instead.

KV rows per sequence: [0, ctx) the context, written once and restored after an arm that zeroes
them; [ctx, ctx + q) the question and [ctx + q, ...) completion / decoded tokens, rewritten by
every arm.  State slots: 1..B the sequences, B+1..2B the dasc-wr scratch slots.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_runner.batch import SeqInput
from model_runner.engine import decode_until
from model_runner.processes import is_first_rank
from model_runner.quality.arms import Arm, apply_arm, prefix_kv_rows, prepare_arm, touches_kv
from model_runner.quality.fidelity import greedy_reproduces, mean_kl, mean_nll, scored_logprobs
from model_runner.quality.tasks import TASKS, TaskInstance, make_instances, score_instance
from model_runner.runner import ModelRunner

NEWLINE = 10
DENSE = Arm("dense")


@dataclass(frozen=True, slots=True)
class InstanceScore:
    index: int
    score: float
    kl: float = 0.0
    delta_nll: float = 0.0


@dataclass(frozen=True, slots=True)
class Result:
    """One (arm, task, length): the aggregates and, for paired statistics, every instance."""

    arm: str
    task: str
    length: int
    accuracy: float
    n: int
    kl: float = 0.0
    delta_nll: float = 0.0
    mask_seed: int | None = None
    model: str = ""
    seed: int = 0
    instances: tuple[InstanceScore, ...] = ()

    @property
    def label(self) -> str:
        return Arm(self.arm, self.mask_seed).label

    @classmethod
    def of(cls, model: str, arm: Arm, task: str, length: int, seed: int,
           scores: list[InstanceScore]) -> Result:
        n = len(scores)
        return cls(arm.name, task, length, sum(s.score for s in scores) / n, n,
                   sum(s.kl for s in scores) / n, sum(s.delta_nll for s in scores) / n,
                   arm.mask_seed, model, seed, tuple(scores))

    def to_json(self) -> dict:
        row = {"model": self.model, "arm": self.arm, "task": self.task, "length": self.length,
               "accuracy": self.accuracy, "n": self.n, "kl": self.kl,
               "delta_nll": self.delta_nll, "seed": self.seed}
        if self.mask_seed is not None:
            row["mask_seed"] = self.mask_seed
        row["instances"] = {k: [getattr(s, k) for s in self.instances]
                            for k in ("index", "score", "kl", "delta_nll")}
        return row

    @classmethod
    def from_json(cls, row: dict) -> Result:
        inst = row.get("instances", {})
        scores = tuple(InstanceScore(*v) for v in zip(
            *(inst.get(k, []) for k in ("index", "score", "kl", "delta_nll"))))
        return cls(row["arm"], row["task"], row["length"], row["accuracy"], row["n"],
                   row.get("kl", 0.0), row.get("delta_nll", 0.0), row.get("mask_seed"),
                   row.get("model", ""), row.get("seed", 0), scores)

    def key(self) -> tuple:
        """What identifies a finished unit of work in a resumable output file."""
        return (self.model, self.arm, self.mask_seed, self.task, self.length, self.n, self.seed)


@dataclass(slots=True)
class Prompt:
    context: list[int]
    question: list[int]
    completion: list[int]
    pages: list[int]
    slot: int

    @property
    def suffix(self) -> list[int]:
        return self.question + self.completion


@dataclass(slots=True)
class Forced:
    """Teacher-forced pass of one arm over a batch."""

    logits: list[torch.Tensor]  # per sequence [t, V]
    after_question: list  # per sequence: RequestState after the question
    last_logits: torch.Tensor  # [B, V] at each question's last token
    logp: list[torch.Tensor] = field(default_factory=list)  # per sequence [t - 1, V]


def prefill(runner: ModelRunner, insts: list[TaskInstance], encode) -> list[Prompt]:
    spec, page = TASKS[insts[0].task], runner.rc.page_size
    prompts, free = [], list(range(runner.rc.num_pages))
    for i, inst in enumerate(insts):
        ctx, question, completion = (encode(inst.context), encode(inst.question),
                                     encode(inst.completion))
        tail = max(len(completion), spec.max_new_tokens)
        num_pages = -(-(len(ctx) + len(question) + tail) // page)
        prompts.append(Prompt(ctx, question, completion, [free.pop() for _ in range(num_pages)],
                              i + 1))
    runner.forward([SeqInput(p.context, 0, p.pages, p.slot) for p in prompts])
    return prompts


def teacher_force(runner: ModelRunner, prompts: list[Prompt]) -> Forced:
    """Question, then completion, on top of each slot's state; logits of every suffix token."""
    q_seqs = [SeqInput(p.question, len(p.context), p.pages, p.slot) for p in prompts]
    q_logits = runner.forward(q_seqs, all_logits=True)  # [sum q, V]
    after = [runner.read_state(p.slot) for p in prompts]
    a_seqs = [SeqInput(p.completion, len(p.context) + len(p.question), p.pages, p.slot)
              for p in prompts]
    a_logits = runner.forward(a_seqs, all_logits=True)  # [sum a, V]
    q_split = q_logits.split([len(p.question) for p in prompts])
    a_split = a_logits.split([len(p.completion) for p in prompts])
    logits = [torch.cat([q, a]) for q, a in zip(q_split, a_split)]
    last = torch.stack([q[-1] for q in q_split])
    return Forced(logits, after, last, [scored_logprobs(x) for x in logits])


def greedy_texts(runner: ModelRunner, prompts: list[Prompt], forced: Forced, max_new: int,
                 decode, decode_all: bool) -> list[str]:
    texts: list[str | None] = [None] * len(prompts)
    for i, p in enumerate(prompts):
        if (not decode_all and len(p.completion) <= max_new
                and greedy_reproduces(forced.logits[i], len(p.question), p.completion)):
            texts[i] = decode(p.completion)
    todo = [i for i, t in enumerate(texts) if t is None]
    if todo:
        for i in todo:  # back to the state after the question
            runner.write_state(prompts[i].slot, forced.after_question[i])
        steps = [SeqInput(prompts[i].question, len(prompts[i].context), prompts[i].pages,
                          prompts[i].slot) for i in todo]
        outputs = decode_until(runner, steps, forced.last_logits[todo], max_new, {NEWLINE})
        for i, out in zip(todo, outputs):
            texts[i] = decode(out)
    return texts


def run_batch(runner: ModelRunner, insts: list[TaskInstance], arms: list[Arm], pools: dict,
              encode, decode, decode_all: bool = False) -> dict[Arm, list[InstanceScore]]:
    """Every arm on one batch of instances of one task and length."""
    spec = TASKS[insts[0].task]
    prompts = prefill(runner, insts, encode)
    dense_states = [runner.read_state(p.slot) for p in prompts]
    ctx_seqs = [SeqInput([], len(p.context), p.pages, p.slot) for p in prompts]
    contexts = [p.context for p in prompts]
    ref: Forced | None = None
    ref_nll: list[float] = []
    out = {}
    for arm in [DENSE] + [a for a in arms if a != DENSE]:
        if ref is not None:
            for p, state in zip(prompts, dense_states):
                runner.write_state(p.slot, state)
        saved_kv = None
        if touches_kv(arm.name):
            rows = torch.cat([prefix_kv_rows(runner, s) for s in ctx_seqs])
            saved_kv = (rows, [cache[rows].clone() for cache in runner.kv.caches])
        runner.checkpoints = pools.get(arm)
        apply_arm(runner, ctx_seqs, arm.name, contexts)
        forced = teacher_force(runner, prompts)
        if ref is None:
            ref = forced
            ref_nll = [mean_nll(lp, p.suffix) for lp, p in zip(ref.logp, prompts)]
        if arm in arms:
            texts = greedy_texts(runner, prompts, forced, spec.max_new_tokens, decode, decode_all)
            out[arm] = [
                InstanceScore(inst.index, score_instance(inst, text), mean_kl(r, lp),
                              mean_nll(lp, p.suffix) - nll)
                for inst, text, r, lp, p, nll in zip(insts, texts, ref.logp, forced.logp,
                                                     prompts, ref_nll)]
        if saved_kv is not None:
            rows, values = saved_kv
            for cache, v in zip(runner.kv.caches, values):
                cache[rows] = v
    return out


def sweep(runner: ModelRunner, model: str, tasks: list[str], lengths: list[int], n: int,
          seed: int, arms: list[Arm], batch: int, tokenizer, done: set | frozenset = frozenset(),
          emit: Callable[[list[Result]], None] | None = None, decode_all: bool = False
          ) -> list[Result]:
    """Every arm on ``n`` instances of every (task, length); units whose results are already in
    ``done`` (``Result.key()``s) are skipped, and each finished unit goes to ``emit``."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    pools = {a: prepare_arm(runner, a.name, batch, a.mask_seed) for a in arms}
    units = [(length, task) for length in lengths for task in tasks]
    results, start_time, num_run = [], time.monotonic(), 0
    for k, (length, task) in enumerate(units):
        pending = [a for a in arms if (model, a.name, a.mask_seed, task, length, n, seed)
                   not in done]
        if not pending:
            continue
        unit_start, unit_cpu = time.monotonic(), time.process_time()
        insts = make_instances(task, length, n, seed)
        scores: dict[Arm, list[InstanceScore]] = {a: [] for a in pending}
        for start in range(0, n, batch):
            group = run_batch(runner, insts[start : start + batch], pending, pools, encode,
                              decode, decode_all)
            for a in pending:
                scores[a] += group[a]
        unit = [Result.of(model, a, task, length, seed, scores[a]) for a in pending]
        results += unit
        if emit is not None:
            emit(unit)
        num_run += 1
        if is_first_rank():  # progress on stderr; stdout stays the table / JSON lines
            elapsed = time.monotonic() - start_time
            eta = elapsed / num_run * (len(units) - k - 1)
            print(f"[dasc-eval] {model} {task} {length}: {len(pending)} arms x {n} in "
                  f"{time.monotonic() - unit_start:.1f} s, cpu "
                  f"{time.process_time() - unit_cpu:.1f} s (unit {k + 1}/{len(units)}, "
                  f"eta {eta / 60:.1f} min)", file=sys.stderr, flush=True)
    return results
