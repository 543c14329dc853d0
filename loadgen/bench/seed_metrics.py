"""Per-seed metrics of one arm's run, and their mean +- sample SD over seeds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from loadgen.stream import RequestResult
from loadgen.summary import summarize

TELEMETRY_KEYS = ("prompt_tokens", "cached_tokens", "loads_nr", "loads_wr", "refresh_tokens",
                  "parked_hits", "checkpoints_evicted", "kv_evicted_rows", "num_steps", "step_s",
                  "compute_s")


def run_metrics(results: list[RequestResult], duration: float, deltas: list[dict | None]
                ) -> dict:
    """What the tables need from one (arm, seed): the loadgen summary's headline numbers, the
    TTFT of hits and misses apart, and the server's own counters summed over the timed
    windows (``deltas``: /v1/stats differences across each window)."""
    s = summarize(results, duration)
    done = [r for r in results if r.ok]
    hits = [r.ttft_ms for r in done if r.cached_tokens]
    misses = [r.ttft_ms for r in done if not r.cached_tokens]
    out = {k: s[k] for k in ("completed", "failed", "duration", "total_input_tokens",
                             "total_cached_tokens", "num_hits", "cache_hit_rate",
                             "input_throughput", "request_throughput", "mean_ttft_ms",
                             "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_e2el_ms")}
    out["errors"] = s["errors"]
    out["mean_ttft_hit_ms"] = statistics.fmean(hits) if hits else None
    out["mean_ttft_miss_ms"] = statistics.fmean(misses) if misses else None
    server = {k: 0 for k in TELEMETRY_KEYS}
    for d in deltas:
        for k in TELEMETRY_KEYS:
            server[k] += (d or {}).get(k, 0)
    out["server"] = server
    return out


def per_seed(seeds: dict, key: str) -> list:
    """One metric of every seed of an arm (``seeds``: seed -> metrics)."""
    return [m[key] for m in seeds.values()]


def mean_sd(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def pm(values: list[float | None], digits: int = 1, scale: float = 1.0) -> str:
    m, sd = mean_sd(values)
    if m is None:
        return "n/a"
    return f"{m * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, default=float) + "\n")
