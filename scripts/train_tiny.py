"""Train a tiny byte-level Kimi-Linear (KDA) or Qwen3-Next (GDN) model on the task suite (CPU).

    nice -n 10 .venv/bin/python scripts/train_tiny.py --model kimi-linear-tiny --minutes 52

Reproducible: model init, the decay parameters and every batch are pure functions of the seed
and the step number (batch instances come from ``make_instances`` with training seeds >= 10^7,
far from evaluation seeds).  Resumable: a checkpoint (model, optimiser, step, elapsed training
time) is written to ``<out>/<model>/ckpt.pt`` every few minutes and at the end, and a rerun of
the same command continues from it.  The run stops by training time; the learning rate follows
the elapsed fraction of that budget.  At the end the model is saved with ``save_pretrained`` plus
the byte tokenizer into ``<out>/<model>/final`` (and ``--export-dir`` if given), then a quick
greedy-decoding evaluation is written to ``eval.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import tiny_models as tm  # first: blocks fla, patches the chunk functions
import torch
import torch.nn.functional as F
from tiny_eval import family_table, quick_eval
from train_batches import make_batch

from model_runner.byte_tokenizer import write_byte_tokenizer


def reset_mask(resets: torch.Tensor, width: int) -> torch.Tensor | None:
    """[B, T] mask for ``tm.set_state_reset`` from per-row positions (-1: none); None if none."""
    rows = (resets >= 0).nonzero().flatten()
    if not len(rows):
        return None
    mask = torch.zeros(len(resets), width, dtype=torch.bool)
    mask[rows, resets[rows]] = True
    return mask


def losses(model, ids, answer, valid, is_copy, pointers=None):
    """(answer loss, LM loss on the rest, answer-token accuracy on task rows, on copy rows,
    attention-pointer loss); masks index target tokens; an accuracy is NaN when the batch has
    no such rows.  With ``pointers`` ([N, 3]: row, position, source), the pointer loss is the
    mean -log attention weight that head 0 of every full-attention layer gives the source."""
    out = model(input_ids=ids, output_attentions=pointers is not None)
    logits = out.logits[:, :-1].float()
    pointer_loss = torch.zeros(())
    if pointers is not None and len(pointers):
        b, pos, src = pointers.unbind(1)
        probs = torch.stack([a[b, 0, pos, src] for a in out.attentions if a is not None])
        pointer_loss = -probs.float().clamp_min(1e-6).log().mean()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    ans, rest = answer[:, 1:], valid[:, 1:] & ~answer[:, 1:]
    hit = logits.argmax(-1) == ids[:, 1:]
    task_acc = hit[ans & ~is_copy[:, None]].float().mean()
    copy_acc = hit[ans & is_copy[:, None]].float().mean()
    return nll[ans].mean(), nll[rest].mean(), task_acc, copy_acc, pointer_loss


def lr_at(frac: float, step: int, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def make_optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay, plain = [], []
    for name, p in model.named_parameters():
        is_plain = p.dim() < 2 or name.endswith(("A_log", "dt_bias"))
        (plain if is_plain else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def save_checkpoint(path: Path, model, opt, step: int, elapsed: float, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
             "elapsed": elapsed, "history": history}
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-write never leaves a broken checkpoint


def export(model, target: Path) -> None:
    """save_pretrained (config.json + model.safetensors, fp32) plus the byte tokenizer."""
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target)
    write_byte_tokenizer(target)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    run_dir = Path(args.out) / args.model
    run_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(run_dir / "train.log", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    model = tm.build_model(args.model, args.seed)
    tm.set_fast_chunks(True)
    if args.pointer_weight > 0:  # attention weights are only returned by the eager path
        model.config._attn_implementation = "eager"
    opt = make_optimizer(model, args.lr)
    step, elapsed, history = 0, 0.0, []
    ckpt = run_dir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        log(f"resumed {args.model} at step {step}, {elapsed / 60:.1f} min trained")
    else:
        if args.init_from:  # e.g. the shipped weights, when no checkpoint of this run exists
            source = Path(args.init_from)
            if source.suffix == ".pt":  # another run's checkpoint: its weights only
                model.load_state_dict(torch.load(source, weights_only=False)["model"])
            else:
                from safetensors.torch import load_file

                model.load_state_dict(load_file(source / "model.safetensors"))
            log(f"initialised {args.model} from {args.init_from}")
        original, fast = tm.check_patch(model)
        log(f"start {args.model}: {sum(p.numel() for p in model.parameters())} params; "
            f"patch check loss original={original:.6f} fast={fast:.6f}")
    budget = args.minutes * 60
    last_save, window = time.time(), []
    model.train()
    while elapsed < budget and (args.max_steps is None or step < args.max_steps):
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / budget, step, args)
        ids, answer, valid, is_copy, pointers, resets = make_batch(
            step, args.tokens_per_step, args.seed, args.extra_questions, args.length_weights,
            args.task_weights, args.state_reset)
        supervise = pointers if args.pointer_weight > 0 else None
        tm.set_state_reset(reset_mask(resets, ids.shape[1]))
        try:
            ans_loss, lm_loss, acc, copy_acc, ptr_loss = losses(model, ids, answer, valid,
                                                                is_copy, supervise)
        finally:
            tm.set_state_reset(None)
        loss = ans_loss + args.lm_weight * lm_loss + args.pointer_weight * ptr_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += time.time() - t0
        window.append((ans_loss.item(), lm_loss.item(), acc.item(), copy_acc.item(),
                       ptr_loss.item()))
        if step % args.log_every == 0:
            a, m, c, k, q = (_nanmean([w[i] for w in window]) for i in range(5))
            history.append({"step": step, "min": elapsed / 60, "ans_loss": a, "lm_loss": m,
                            "ans_acc": c, "copy_acc": k, "pointer_loss": q})
            log(f"step {step} {elapsed / 60:.1f}min lr={opt.param_groups[0]['lr']:.2e} "
                f"ans_loss={a:.3f} lm_loss={m:.3f} ans_tok_acc={c:.3f} copy_acc={k:.3f} "
                f"ptr_loss={q:.3f} "
                f"({(time.time() - t0):.1f}s/step, len {ids.shape[1]})")
            window = []
        if time.time() - last_save > args.save_every_min * 60:
            save_checkpoint(ckpt, model, opt, step, elapsed, history)
            last_save = time.time()
    save_checkpoint(ckpt, model, opt, step, elapsed, history)
    log(f"training done: step {step}, {elapsed / 60:.1f} min")
    export(model, run_dir / "final")
    if args.export_dir:
        export(model, Path(args.export_dir))
        log(f"exported to {args.export_dir}")
    hs = torch.cat(tm.static_horizons(model))
    under = {w: int((hs <= w).sum()) for w in (16, 64, 128, 512)}
    log(f"static horizons: {hs.numel()} units, min {hs.min():.1f} max {hs.max():.1f}, "
        f"<= W_max {under}")
    if args.eval_n > 0:
        results = quick_eval(model, args.eval_lengths, args.eval_n, log=log)
        families = family_table(results)
        (run_dir / "eval.json").write_text(json.dumps(
            {"step": step, "minutes": elapsed / 60, "tasks": results, "families": families,
             "horizons_under": under, "history": history}, indent=1))
        for fam, by_len in families.items():
            log(f"family {fam:12s} " + " ".join(f"{n}:{a:.2f}" for n, a in by_len.items()))


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def _length_weights(text: str) -> dict[int, float]:
    pairs = (item.split(":") for item in text.split(","))
    return {int(length): float(weight) for length, weight in pairs}


def _task_weights(text: str) -> dict[str, float]:
    pairs = (item.split(":") for item in text.split(","))
    return {task: float(weight) for task, weight in pairs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=tm.MODEL_NAMES, required=True)
    p.add_argument("--out", default="out/train")
    p.add_argument("--export-dir", default=None, help="also save the final model here")
    p.add_argument("--minutes", type=float, default=52.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--lm-weight", type=float, default=0.1)
    p.add_argument("--pointer-weight", type=float, default=0.0,
                   help="weight of the attention-pointer loss (0: off): head 0 of each "
                        "full-attention layer is taught to attend, at every answer position "
                        "of a copy row or needle question (S, MK, MQ, MV), to the character "
                        "to copy")
    p.add_argument("--state-reset", type=float, default=0.0,
                   help="fraction of needle rows (S, MK, MQ, MV) whose linear-layer state is "
                        "reset where the question starts, as on a cache hit that lost it "
                        "(0: off)")
    p.add_argument("--extra-questions", type=int, default=0,
                   help="extra needle questions appended per needle-task sequence (0: off)")
    p.add_argument("--length-weights", type=_length_weights, default=None,
                   help="training context lengths, e.g. 192:0.3,256:0.4,512:0.3 "
                        "(default: the recorded run's mix)")
    p.add_argument("--task-weights", type=_task_weights, default=None,
                   help="training task mix, e.g. s1:1,mk1:1,copy:2 (default: every suite task); "
                        "'copy' adds repeated random strings (induction warm-up)")
    p.add_argument("--init-from", default=None,
                   help="start from a saved model folder (e.g. model_runner/assets/<model>) or "
                        "another run's ckpt.pt instead of a fresh init; ignored when resuming")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every-min", type=float, default=4.0)
    p.add_argument("--eval-n", type=int, default=10, help="instances per task and length")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    train(p.parse_args())


if __name__ == "__main__":
    main()
