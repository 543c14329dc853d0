"""Offline generation: ``python -m model_runner.generate --prompt "..." --max-new-tokens 16``.

With ``--tp N`` (N > 1) the command re-launches itself under ``torchrun --standalone`` with N
ranks; rank 0 prints.  Inputs are validated before any rank starts, so bad input costs no launch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from client.cli_help import DefaultsHelpFormatter
from model_runner.config import DEFAULT_MODEL
from model_runner.processes import is_first_rank, is_rank_process, relaunch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m model_runner.generate",
        description="Generate tokens from a hybrid checkpoint (HF format: Qwen3.5, Qwen3-Next, "
                    "OLMo-Hybrid, Kimi-Linear) with "
                    "dasc's tensor-parallel runner. Prints the generated token ids (and text when "
                    "the model folder has a tokenizer).", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="folder with config.json and *.safetensors (default: the built-in tiny "
                        "Kimi-Linear model, %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model folder)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens to generate at most (fewer at the model's eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations; auto: the checkpoint's bfloat16 where this "
                        "device computes bf16 natively, else float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    p.add_argument("--json", action="store_true", help="print one JSON object with token_ids")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def load_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got "
                             f"{args.prompt_ids!r}") from None
    else:
        if tokenizer is None:
            raise ValueError(f"{args.model}: no tokenizer in the model folder; use --prompt-ids")
        ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def validate(args: argparse.Namespace) -> list[int]:
    """Everything that can be checked without loading weights; raises with a one-line message."""
    from model_runner.config import ModelConfig
    from model_runner.model_files import check_tp, check_weight_files

    model_dir = Path(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    check_tp(cfg, args.tp, str(model_dir / "config.json"))
    check_weight_files(model_dir)
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    ids = prompt_ids(args, load_tokenizer(model_dir))
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size}) of "
                         f"{model_dir / 'config.json'}")
    return ids


def run_rank(args: argparse.Namespace, ids: list[int]) -> None:

    from model_runner.engine import OfflineEngine
    from model_runner.model_files import resolve_dtype
    from model_runner.parallel import init_tp_group, rank_device, shutdown_tp_group
    from model_runner.runner import ModelRunner, RunnerConfig

    device = rank_device(args.device)
    tp = init_tp_group(device)
    page_size = 16
    num_pages = -(-(len(ids) + args.max_new_tokens) // page_size) + 1
    dtype = resolve_dtype(args.dtype, args.model, str(device))
    rc = RunnerConfig(args.model, dtype=dtype, device=str(device), num_pages=num_pages,
                      page_size=page_size, num_state_slots=2)
    runner = ModelRunner(rc, tp)
    out = OfflineEngine(runner).generate([ids], args.max_new_tokens, args.temperature, args.seed,
                                         eos_token_id=runner.cfg.eos_token_id)[0]
    if tp.is_first:
        tokenizer = load_tokenizer(Path(args.model))
        text = tokenizer.decode(out) if tokenizer is not None else None
        if args.json:
            print(json.dumps({"token_ids": out, "text": text, "prompt_ids": ids}))
        else:
            print("token_ids:", " ".join(map(str, out)))
            if text is not None:
                print("text:", text)
    shutdown_tp_group(tp)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ids = validate(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tp > 1 and not is_rank_process():
        return relaunch(args.tp, "model_runner.generate",
                        argv if argv is not None else sys.argv[1:])
    try:
        run_rank(args, ids)
    except (ValueError, OSError, RuntimeError) as e:
        if is_first_rank():
            print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
