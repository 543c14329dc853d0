"""Summary of timed requests, named as ``vllm bench serve`` / SGLang ``bench_serving`` name them.

Latency statistics are over completed requests: mean, median, std (population, numpy's
default, as vLLM), p90, p99 (numpy's linear percentile).  Throughputs divide by the timed
window.  ``cache_hit_rate`` is token-weighted, sum(cached) / sum(prompt), over the completed
requests whose server reported cached tokens; None ("not reported") when none did.  Requests
tagged ``cold`` (first of a shared-prefix group, first turn) and the rest (warm) get their own
TTFT statistics.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from loadgen.stream import RequestResult

PERCENTILES = (90, 99)


def latency_stats(name: str, values: list[float], prefix: str = "") -> dict:
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if not values:
        return {f"{prefix}{k}_{name}_ms": None for k in keys}
    a = np.asarray(values, dtype=float)
    out = {f"{prefix}mean_{name}_ms": float(a.mean()), f"{prefix}median_{name}_ms":
           float(np.median(a)), f"{prefix}std_{name}_ms": float(a.std())}
    for p in PERCENTILES:
        out[f"{prefix}p{p}_{name}_ms"] = float(np.percentile(a, p))
    return out


def hit_rate(results: list[RequestResult]) -> float | None:
    reported = [r for r in results if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    s: dict = {
        "completed": len(done), "failed": len(failed), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "cache_hit_rate": hit_rate(results),
        "num_hits": sum(1 for c in cached if c > 0) if cached else None,
    }
    s.update(latency_stats("ttft", [r.ttft_ms for r in done]))
    s.update(latency_stats("ttfb", [r.ttfb_ms for r in done]))
    s.update(latency_stats("e2el", [r.e2el_ms for r in done]))
    s.update(latency_stats("tpot", [r.tpot_ms for r in done if r.tpot_ms is not None]))
    s.update(latency_stats("itl", [x for r in done for x in r.itl_ms]))
    if any("cold" in r.tags for r in results):
        for label, want in (("cold", True), ("warm", False)):
            part = [r for r in done if r.tags.get("cold") is want]
            s[f"{label}_completed"] = len(part)
            s[f"{label}_cache_hit_rate"] = hit_rate(part)
            s.update(latency_stats("ttft", [r.ttft_ms for r in part], prefix=f"{label}_"))
    s["errors"] = dict(Counter(r.error for r in failed).most_common(10))
    return s


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "not reported"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_table(s: dict, title: str = "Serving Benchmark Result") -> str:
    rows: list[tuple[str, object] | str] = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", s["duration"]),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total cached tokens:", s["total_cached_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Cache hit rate (tokens):", s["cache_hit_rate"] if s["cache_hit_rate"] is None
         else f"{s['cache_hit_rate']:.4f}"),
        ("Request throughput (req/s):", s["request_throughput"]),
        ("Input token throughput (tok/s):", s["input_throughput"]),
        ("Output token throughput (tok/s):", s["output_throughput"]),
    ]
    for name, label in (("ttft", "Time to First Token"), ("ttfb", "Time to First Byte"),
                        ("e2el", "End-to-end Latency"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency")):
        if s.get(f"mean_{name}_ms") is None and name in ("tpot", "itl"):
            continue
        rows.append(label)
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms):", s[f"{stat}_{name}_ms"]))
    for label in ("cold", "warm"):
        if f"{label}_completed" in s:
            rows.append(f"TTFT of {label} requests ({s[f'{label}_completed']})")
            rows.append((f"Mean {label} TTFT (ms):", s[f"{label}_mean_ttft_ms"]))
            rows.append((f"Median {label} TTFT (ms):", s[f"{label}_median_ttft_ms"]))
    lines = [f"{' ' + title + ' ':=^56}"]
    for row in rows:
        if isinstance(row, str):
            lines.append(f"{' ' + row + ' ':-^56}")
        else:
            lines.append(f"{row[0]:<40}{_fmt(row[1]):>16}")
    if s["errors"]:
        lines.append(f"{' Errors ':-^56}")
        lines += [f"{n:>6} x {msg}" for msg, n in s["errors"].items()]
    lines.append("=" * 56)
    return "\n".join(lines)
