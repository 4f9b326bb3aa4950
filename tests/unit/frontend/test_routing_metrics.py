"""The routing metrics as an operator scrapes them: hit rate counters, decisions by reason,
the index and the streams read at scrape time, a departed worker's series gone."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sidecar_frontend.routing.index import BlockIndex
from sidecar_frontend.routing.metrics import RoutingMetrics, StreamRow


def test_predicted_and_reported_cached_tokens_per_worker() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    metrics.usage("w1", predicted=2048, reported=2032, prompt=2100)
    metrics.usage("w1", predicted=0, reported=16, prompt=50)
    get = metrics.registry.get_sample_value
    assert get("frontend_kv_predicted_cached_tokens_total", {"worker": "w1"}) == 2048
    assert get("frontend_kv_reported_cached_tokens_total", {"worker": "w1"}) == 2048
    assert get("frontend_kv_prompt_tokens_total", {"worker": "w1"}) == 2150
    metrics.forget_worker("w1")
    assert get("frontend_kv_prompt_tokens_total", {"worker": "w1"}) is None


def test_the_events_lag_per_worker_goes_with_the_worker() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    metrics.events_lagged("w1", 0.003)
    metrics.events_lagged("w1", 45.0)
    get = metrics.registry.get_sample_value
    assert get("frontend_kv_events_lag_seconds_count", {"worker": "w1"}) == 2
    assert get("frontend_kv_events_lag_seconds_bucket", {"worker": "w1", "le": "0.005"}) == 1
    assert get("frontend_kv_events_lag_seconds_bucket", {"worker": "w1", "le": "30.0"}) == 1
    metrics.forget_worker("w1")
    assert get("frontend_kv_events_lag_seconds_count", {"worker": "w1"}) is None


def test_decisions_by_role_and_reason() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    metrics.decided("agg", "affinity")
    metrics.decided("agg", "affinity")
    metrics.decided("prefill", "hot_spot")
    get = metrics.registry.get_sample_value
    assert get("frontend_routing_decisions_total", {"role": "agg", "reason": "affinity"}) == 2
    assert get("frontend_routing_decisions_total", {"role": "prefill", "reason": "hot_spot"}) == 1


def test_the_index_and_the_streams_are_read_at_each_scrape() -> None:
    metrics = RoutingMetrics(CollectorRegistry())
    index = BlockIndex(max_bytes=1 << 20)
    rows = [
        StreamRow("w1", "m", live=True, engine_publishes=True, deltas=5, gaps=1, resyncs=2),
        StreamRow(
            "w2", "m", live=False, engine_publishes=True, deltas=0, gaps=0, resyncs=0, foreign_keys=True
        ),
    ]
    metrics.watch(lambda: {"m": index}, lambda: rows, 1 << 20)
    get = metrics.registry.get_sample_value
    index.store("w1", [1, 2, 3])
    index.store("w2", [1])
    assert get("frontend_kv_index_blocks", {"model": "m"}) == 3
    assert get("frontend_kv_index_entries", {"model": "m"}) == 4
    assert get("frontend_kv_index_bytes", {"model": "m"}) == index.bytes
    assert get("frontend_kv_index_max_bytes") == 1 << 20
    assert get("frontend_kv_index_evicted_blocks_total", {"model": "m"}) == 0
    assert get("frontend_kv_stream_live", {"worker": "w1", "model": "m", "publishing": "true"}) == 1
    assert get("frontend_kv_stream_gaps_total", {"worker": "w1"}) == 1
    assert get("frontend_kv_stream_resyncs_total", {"worker": "w1"}) == 2
    assert get("frontend_kv_stream_updates_total", {"worker": "w1"}) == 5
    assert get("frontend_kv_stream_foreign_keys", {"worker": "w1"}) == 0
    assert get("frontend_kv_stream_foreign_keys", {"worker": "w2"}) == 1  # another key layout
    rows.clear()
    assert get("frontend_kv_stream_gaps_total", {"worker": "w1"}) is None
