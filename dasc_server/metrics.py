"""``GET /metrics``: Prometheus text format (prometheus-client), one registry per app.

Latency histograms and the abort counter are observed by the front end as requests run; the
scheduler's pools and counters are read with one ``Stats`` round trip at scrape time, so a
scrape always shows the current state (no background polling, nothing stale).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler.wire.messages import ServerInfo, Stats
from scheduler.wire.serve_config import LoadPolicy

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SchedulerCollector:
    """Turns the latest ``Stats`` into metric families when the registry is collected."""

    def __init__(self, info: ServerInfo):
        self.info = info
        self.stats: Stats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        gauges = {
            "dasc_kv_rows_total": ("KV pool size in tokens", s.kv_rows_total),
            "dasc_kv_rows_used": ("KV rows cached or held by requests",
                                  s.kv_rows_total - s.kv_rows_free),
            "dasc_kv_rows_cached": ("KV rows held by the prefix cache", s.kv_rows_cached),
            "dasc_checkpoint_slots_total": ("checkpoint slots", s.checkpoint_slots_total),
            "dasc_checkpoint_slots_used": ("checkpoint slots cached or being written",
                                           s.checkpoint_slots_total - s.checkpoint_slots_free),
            "dasc_checkpoint_bytes_per_slot": ("worst-rank bytes of one checkpoint slot",
                                               self.info.rank.checkpoint_bytes_per_slot),
            "dasc_running_requests": ("requests holding an active state slot", s.num_running),
            "dasc_queued_requests": ("requests waiting for admission", s.num_waiting),
            "dasc_integrity_ok": ("1 if the scheduler's integrity check passed",
                                  int(s.integrity == "ok")),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        c = s.counters
        yield GaugeMetricFamily("dasc_cache_hit_rate", "cached / prompt tokens (token-weighted)",
                                value=c.cached_tokens / c.prompt_tokens if c.prompt_tokens
                                else 0.0)
        counters = {
            "dasc_prompt_tokens": ("prompt tokens admitted", c.prompt_tokens),
            "dasc_cached_tokens": ("prompt tokens restored from the prefix cache",
                                   c.cached_tokens),
            "dasc_kv_evicted_rows": ("KV rows evicted from the cache", c.kv_evicted_rows),
            "dasc_checkpoints_evicted": ("checkpoints evicted", c.checkpoints_evicted),
            "dasc_checkpoints_stored": ("checkpoints stored", c.checkpoints_stored),
            "dasc_refresh_tokens": ("tokens replayed by dasc-wr refreshes", c.refresh_tokens),
            "dasc_parked_hits": ("hits that adopted a finished request's parked slot (exact, "
                                 "no load)", c.parked_hits),
            "dasc_screened_tokens": ("greedy tokens the screened LM head gave",
                                     c.screened_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        loads = CounterMetricFamily("dasc_checkpoint_loads", "checkpoint loads (hits) by policy",
                                    labels=["policy"])
        for policy in LoadPolicy:
            loads.add_metric([policy.value], c.loads(policy))
        yield loads
        yield from _tier_families(s.tier)


def _tier_families(t):
    """The second cache tier's families (none without one)."""
    if t is None:
        return
    for name, doc, value in (
            ("dasc_tier_entries", "second-tier entries on disk", t.entries),
            ("dasc_tier_bytes", "second-tier bytes, writes in flight included", t.bytes),
            ("dasc_tier_budget_bytes", "--cache-tier-bytes", t.budget_bytes)):
        yield GaugeMetricFamily(name, doc, value=value)
    for name, doc, value in (
            ("dasc_tier_spills", "entries written to the second tier", t.spills),
            ("dasc_tier_spill_bytes", "bytes written to the second tier", t.spill_bytes),
            ("dasc_tier_spill_failures", "entries that failed to write", t.spill_failed),
            ("dasc_tier_loads", "entries read back from the second tier (hits)", t.fetches),
            ("dasc_tier_load_bytes", "bytes read back from the second tier", t.fetch_bytes),
            ("dasc_tier_load_seconds", "rank 0's time reading them", t.fetch_s),
            ("dasc_tier_load_failures", "entries dropped on a failed check", t.fetch_failed),
            ("dasc_tier_evictions", "entries dropped for the byte budget", t.evicted)):
        yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, info: ServerInfo):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("dasc_time_to_first_token_seconds", "request arrival to first "
                              "token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("dasc_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.aborted = Counter("dasc_aborted_requests", "requests aborted (client gone, stop "
                               "string)", registry=self.registry)
        self.finished = Counter("dasc_finished_requests", "requests finished",
                                ["finish_reason"], registry=self.registry)
        # requests the front end is still rendering and tokenizing: not yet the scheduler's
        self.preparing = Gauge("dasc_preparing_requests", "requests whose prompt the front end "
                               "is still rendering or tokenizing", registry=self.registry)
        self._scheduler = _SchedulerCollector(info)
        self.registry.register(self._scheduler)

    def render(self, stats: Stats) -> bytes:
        self._scheduler.stats = stats
        return generate_latest(self.registry)
