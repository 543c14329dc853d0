"""``python -m client "text"``: stream one answer to stdout, then a usage line on stderr.

    python -m client "text" [--base-url URL] [--max-tokens N] [--temperature T] [--chat]
                            [--api-key KEY] [--model NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

from client.api import DascClient
from client.cli_help import DefaultsHelpFormatter
from client.transport import DEFAULT_BASE_URL
from client.types import DascError, StreamEvent, Usage


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("prompt", help="prompt text (a user message with --chat)")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server's address")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--api-key", default=None,
                        help="sent as a bearer token (default: no Authorization header)")
    parser.add_argument("--model", default=None,
                        help="sent as the request's model (default: not sent)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def summary(usage: Usage | None, ttft_s: float | None, finish_reason: str | None) -> str:
    ttft = f"{ttft_s * 1e3:.1f} ms" if ttft_s is not None else "n/a (no text)"
    if usage is None:
        tokens = "usage not reported"
    else:
        cached = "not reported" if usage.cached_tokens is None else str(usage.cached_tokens)
        tokens = (f"prompt {usage.prompt_tokens} tokens (cached {cached}), "
                  f"completion {usage.completion_tokens} tokens")
    return f"usage: {tokens}, TTFT {ttft}, finish {finish_reason or 'n/a'}"


def run(args: argparse.Namespace) -> int:
    with DascClient(args.base_url, api_key=args.api_key, model=args.model) as client:
        events: Iterator[StreamEvent]
        if args.chat:
            events = client.chat_stream([{"role": "user", "content": args.prompt}],
                                        max_tokens=args.max_tokens,
                                        temperature=args.temperature)
        else:
            events = client.stream(args.prompt, max_tokens=args.max_tokens,
                                   temperature=args.temperature)
        usage, ttft_s, finish_reason = None, None, None
        start = time.perf_counter()  # the generator sends the POST at its first step
        try:
            for event in events:
                if event.text:
                    if ttft_s is None:  # SGLang's rule: role-only and usage frames do not count
                        ttft_s = time.perf_counter() - start
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                usage = event.usage or usage
                finish_reason = event.finish_reason or finish_reason
        finally:
            if ttft_s is not None:  # end the partial answer so "error:" starts its own line
                sys.stdout.write("\n")
            sys.stdout.flush()
    print(summary(usage, ttft_s, finish_reason), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except DascError as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
