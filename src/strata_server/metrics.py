"""Prometheus metrics of one server, in a registry of its own (no globals)."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Routes are labelled by path; anything else is "other", so label values stay few.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/props", "/slots", "/health", "/metrics")

# Conversation cache counters from Engine.stats(), exported as <name>_total.
CACHE_COUNTERS = ("parked", "restored", "live_reused", "checkpoints_saved", "evictions",
                  # the disk tier's: files written and read back, with their bytes and seconds
                  "restored_from_disk", "disk_spills", "disk_spill_bytes", "disk_spill_seconds", "disk_reads",
                  "disk_read_bytes", "disk_read_seconds", "disk_evictions",
                  # making room in the pool: waits for the disk writer to let go of a snapshot's pages
                  "spill_waits", "spill_wait_seconds", "spill_waits_timed_out",
                  # a conversation parked whole in place of its chain (on disk) that left no room
                  "chains_consolidated")
CACHE_GAUGES = ("parked_now", "checkpoints_now", "pool_bytes_used", "pool_bytes_total", "disk_bytes",
                "disk_bytes_total", "disk_foreign_entries")


class Metrics:
    """The server's counters, gauges and histograms, plus the engine's latest
    conversation-cache counters (read through ``cache_stats`` at scrape time)."""

    def __init__(self, cache_stats: Callable[[], dict[str, Any]] = dict,
                 scheduler_stats: Callable[[], dict[str, Any]] = dict, queued: Callable[[], int] = lambda: 0,
                 props: Callable[[], dict[str, Any] | None] = lambda: None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # vLLM's names under strata: (what dashboards built for vLLM read).
        self.vllm_prompt_tokens = Counter("strata:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.vllm_generation_tokens = Counter("strata:generation_tokens", "tokens generated", registry=r)
        self.vllm_ttft = Histogram("strata:time_to_first_token_seconds", "arrival to first generated text",
                                   buckets=(0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.vllm_itl = Histogram("strata:inter_token_latency_seconds", "time between a stream's pieces of text",
                                  buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2),
                                  registry=r)
        self.requests = Counter("strata_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("strata_cached_prompt_tokens",
                                     "prompt tokens that were not prefilled (live or restored state)", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("strata_requests_cancelled", "generations stopped because the client went away",
                                 registry=r)
        self.body_disconnects = Counter("strata_client_disconnects_in_body",
                                        "clients that went away while sending their request body", registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "arrival to first generated text",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.per_token = Histogram("strata_time_per_output_token_seconds", "decode time per token after the first",
                                   buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2), registry=r)
        self.restarts = Counter("strata_engine_restarts", "engine processes started after a crash", registry=r)
        self.crash_refusals = Counter("strata_requests_refused_after_crash",
                                      "requests refused because an identical one was in an engine crash", registry=r)
        self.engine_up = Gauge("strata_engine_up", "1 while an engine is loaded and answering", registry=r)
        self.queue_depth = Gauge("strata_queue_depth", "requests waiting behind the one being served", registry=r)
        r.register(_ConversationCacheCollector(cache_stats, scheduler_stats))
        r.register(_SchedulerCollector(scheduler_stats, queued))
        r.register(_ModelCollector(props))

    def route(self, path: str) -> str:
        return path if path in ROUTES else "other"

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ConversationCacheCollector:
    """Exports the engine's conversation cache counters, when it has a cache:
    what it did, what it skipped, what it took back after a restart (and
    discarded, by reason), and its entries by tier (device: finished
    sequences still resident; ram: snapshots and checkpoints in the staging
    pool; disk: files of the disk tier)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], scheduler: Callable[[], dict[str, Any]] = dict):
        self._stats = stats
        self._scheduler = scheduler

    def describe(self):
        return []

    def collect(self):
        stats = self._stats()
        if not stats:
            return
        for name in CACHE_COUNTERS:
            yield CounterMetricFamily(f"strata_conversation_cache_{name}", f"conversation cache: {name}",
                                      value=stats.get(name, 0))
        skipped = CounterMetricFamily("strata_conversation_cache_skipped",
                                      "parks, restores and checkpoints skipped, by kind and reason",
                                      labels=["kind", "reason"])
        for key, count in sorted(stats.get("skipped_by_reason", {}).items()):
            kind, _, reason = key.partition(":")
            skipped.add_metric([kind, reason], count)
        yield skipped
        recovered = CounterMetricFamily("strata_conversation_cache_recovered",
                                        "entries taken back from the staging pool or the disk at an engine's start",
                                        labels=["kind"])
        for kind in ("snapshots", "checkpoints"):
            recovered.add_metric([kind.removesuffix("s")], stats.get(f"recovered_{kind}", 0))
        yield recovered
        rejected = CounterMetricFamily("strata_conversation_cache_rejected",
                                       "entries found but discarded (cut off, corrupt, another model...), by reason",
                                       labels=["reason"])
        for reason, count in sorted(stats.get("rejected_by_reason", {}).items()):
            rejected.add_metric([reason], count)
        yield rejected
        tiers = GaugeMetricFamily("strata_conversation_cache_entries", "cached conversation state by tier",
                                  labels=["tier"])
        tiers.add_metric(["device"], self._scheduler().get("resident", 0))
        tiers.add_metric(["ram"], stats.get("parked_now", 0) + stats.get("checkpoints_now", 0))
        tiers.add_metric(["disk"], stats.get("disk_entries", 0))
        yield tiers
        for name in CACHE_GAUGES:
            yield GaugeMetricFamily(f"strata_conversation_cache_{name}", f"conversation cache: {name}",
                                    value=stats.get(name, 0))


class _ModelCollector:
    """What the loaded model is, from the engine's ``props`` (nothing before
    an engine has said): a mixture-of-experts model's experts per layer and
    per token (0 for a dense model)."""

    def __init__(self, props: Callable[[], dict[str, Any] | None]):
        self._props = props

    def describe(self):
        return []

    def collect(self):
        props = self._props()
        if not props:
            return
        experts = props.get("experts") or {}
        yield GaugeMetricFamily("strata_model_experts", "experts per layer of a mixture-of-experts model (0: dense)",
                                value=experts.get("count", 0))
        yield GaugeMetricFamily("strata_model_experts_per_token", "experts each token is routed to (0: dense)",
                                value=experts.get("per_token", 0))


class _SchedulerCollector:
    """The engine scheduler's figures under vLLM's metric names (``strata:``
    prefix), from its latest state (sent after each step)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], queued: Callable[[], int]):
        self._stats = stats
        self._queued = queued

    def describe(self):
        return []

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("strata:num_requests_running", "requests decoding or reading their prompt",
                                value=s.get("running", 0))
        yield GaugeMetricFamily("strata:num_requests_waiting", "requests waiting for the engine or for KV blocks",
                                value=s.get("waiting", 0) + self._queued())
        yield GaugeMetricFamily("strata:kv_cache_usage_perc", "fraction of KV blocks held by running requests",
                                value=s.get("kv_usage", 0.0))
        preemptions = CounterMetricFamily("strata:num_preemptions", "running requests preempted for KV blocks",
                                          labels=["outcome"])
        for outcome in ("parked", "recomputed"):
            preemptions.add_metric([outcome], s.get(f"preemptions_{outcome}", 0))
        yield preemptions
        yield CounterMetricFamily("strata:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=s.get("prefix_query_tokens", 0))
        yield CounterMetricFamily("strata:prefix_cache_hits", "prompt tokens found in the prefix cache",
                                  value=s.get("prefix_hit_tokens", 0))
        yield from _speculation_metrics(s)


def _speculation_metrics(s: dict[str, Any]):
    """Speculative decoding's counters under vLLM's names, the skips by
    reason, and the mean tokens a verify step yields (1 + accepted / drafts).
    The scheduler lists every reason and draft position from the start
    (zeros), so the label sets are known without importing the runtime here."""
    drafts = s.get("spec_drafts", 0)
    yield CounterMetricFamily("strata:spec_decode_num_drafts", "verifies run (a decoding sequence and its draft)",
                              value=drafts)
    yield CounterMetricFamily("strata:spec_decode_num_draft_tokens", "draft tokens proposed",
                              value=s.get("spec_draft_tokens", 0))
    yield CounterMetricFamily("strata:spec_decode_num_accepted_tokens", "draft tokens accepted",
                              value=s.get("spec_accepted_tokens", 0))
    per_position = CounterMetricFamily("strata:spec_decode_num_accepted_tokens_per_pos",
                                       "draft tokens accepted at each draft position", labels=["position"])
    skipped = CounterMetricFamily("strata:spec_decode_skipped", "verifies skipped (the step decoded one token)",
                                  labels=["reason"])
    for key, value in s.items():
        if key.startswith("spec_accepted_at_"):
            per_position.add_metric([key.removeprefix("spec_accepted_at_")], value)
        elif key.startswith("spec_skipped_"):
            skipped.add_metric([key.removeprefix("spec_skipped_")], value)
    yield per_position
    yield skipped
    yield GaugeMetricFamily("strata:spec_decode_mean_acceptance_length", "tokens a verify yields on average "
                            "(1 + accepted / drafts; 0 before the first verify)",
                            value=1 + s.get("spec_accepted_tokens", 0) / drafts if drafts else 0.0)
