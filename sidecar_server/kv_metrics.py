"""The KV-event subscription's Prometheus metrics, read from its state at each scrape.

A collector rather than counters moved per event: the feeds already count what matters
(batches, gaps, replays, resyncs by reason), so the event path does no metrics work at all.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar_server.kv_hub import KvCacheHub

__all__ = ["KvEventsCollector"]


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
