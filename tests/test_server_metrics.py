"""The Prometheus exposition of the engine's conversation cache counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from strata_server.metrics import Metrics


def _samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_conversation_cache_counters_with_skips_by_kind_and_reason():
    stats = {"parked": 3, "restored": 2, "evictions": 1, "park_skipped": 2, "checkpoint_skipped": 1,
             "skipped_by_reason": {"park:pool_full": 1, "park:no_pool": 1, "checkpoint:out_of_memory": 1},
             "parked_now": 2, "checkpoints_now": 0, "pool_bytes_used": 4 << 20, "pool_bytes_total": 64 << 20,
             "pool_decision": "staging pool: reserved: 64 MiB of 64 MiB requested"}
    s = _samples(Metrics(cache_stats=lambda: stats))
    assert s["strata_conversation_cache_parked_total"] == 3
    assert s["strata_conversation_cache_restored_total"] == 2
    assert s["strata_conversation_cache_live_reused_total"] == 0
    assert s["strata_conversation_cache_evictions_total"] == 1
    assert s["strata_conversation_cache_skipped_total{kind=park,reason=pool_full}"] == 1
    assert s["strata_conversation_cache_skipped_total{kind=park,reason=no_pool}"] == 1
    assert s["strata_conversation_cache_skipped_total{kind=checkpoint,reason=out_of_memory}"] == 1
    assert s["strata_conversation_cache_pool_bytes_used"] == 4 << 20
    assert s["strata_conversation_cache_pool_bytes_total"] == 64 << 20


def test_no_conversation_cache_exports_no_cache_metrics_and_registries_are_separate():
    a, b = Metrics(), Metrics()
    a.restarts.inc()
    sa, sb = _samples(a), _samples(b)
    assert not any(k.startswith("strata_conversation_cache") for k in sa)
    assert sa["strata_engine_restarts_total"] == 1 and sb["strata_engine_restarts_total"] == 0
    assert a.route("/v1/completions") == "/v1/completions" and a.route("/secret/../x") == "other"
