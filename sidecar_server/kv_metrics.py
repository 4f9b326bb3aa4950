"""The KV-event subscription's Prometheus metrics (:func:`register_kv_events_metrics`).

Mostly a collector read from the subscription's state at each scrape rather than counters
moved per event: the feeds already count what matters (batches, gaps, replays, resyncs by
reason). The one exception is the lag histogram, which needs each live batch's lag: the
subscriber tells the hub, and the hub this histogram (one observation per batch).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar_common.histograms import LATENCY_BUCKETS
from sidecar_server.kv_hub import KvCacheHub, Subscription

__all__ = ["KvEventsCollector", "register_kv_events_metrics"]


def register_kv_events_metrics(registry: CollectorRegistry, hub: KvCacheHub, engine: str) -> Subscription:
    """Export ``hub``'s subscription on ``registry``: its state, and its events' lag (observed
    until the returned subscription is closed; the daemon never closes it, its registry and
    hub living as long as the process)."""
    registry.register(KvEventsCollector(hub, engine))
    # Labelled by engine only, like the batches counter: the ranks share the host's clock
    # and the sidecar's one event loop, so a rank label would multiply the series (17 a
    # label set) without telling an operator anything the engine's lag does not.
    lag = Histogram(
        "sidecar_kv_events_lag_seconds",
        "From the engine's time of a live KV-event batch (its ts) to the sidecar receiving it; "
        "replayed batches are not counted. The two times are different hosts' clocks when the "
        "engine runs elsewhere, so this includes their skew; a negative lag counts as 0",
        ["engine"],
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    return hub.subscribe_lag(lag.labels(engine).observe)


class KvEventsCollector(Collector):
    def __init__(self, hub: KvCacheHub, engine: str) -> None:
        self._hub = hub
        self._engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        hub, engine = self._hub, self._engine
        batches = CounterMetricFamily(
            "sidecar_kv_event_batches",
            "KV-event batches received from the engine, replays included",
            labels=["engine"],
        )
        batches.add_metric([engine], hub.batches_received)
        blocks = GaugeMetricFamily(
            "sidecar_kv_blocks",
            "blocks the sidecar knows the engine's GPU cache holds (WatchKvCache)",
            labels=["engine"],
        )
        blocks.add_metric([engine], len(hub.view))
        gaps = CounterMetricFamily(
            "sidecar_kv_event_gaps",
            "missing KV-event batches detected, by data-parallel rank",
            labels=["engine", "rank"],
        )
        replays = CounterMetricFamily(
            "sidecar_kv_event_replays",
            "replays asked of the engine's replay socket",
            labels=["engine", "rank"],
        )
        resyncs = CounterMetricFamily(
            "sidecar_kv_resyncs",
            "times a publisher's state was forgotten and relearned, by reason",
            labels=["engine", "rank", "reason"],
        )
        for rank, feed in enumerate(hub.feeds):
            counters = feed.counters
            gaps.add_metric([engine, str(rank)], counters.gaps)
            replays.add_metric([engine, str(rank)], counters.replays)
            for reason, count in sorted(counters.resyncs.items()):
                resyncs.add_metric([engine, str(rank), reason], count)
        yield from (batches, blocks, gaps, replays, resyncs)
