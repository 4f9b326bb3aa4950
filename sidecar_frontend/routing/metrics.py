"""The routing metrics: what proves KV-aware routing works, on the frontend's registry.

* the hit rate an operator watches: per worker, the cached prompt tokens the router predicted
  when it chose the worker, the cached tokens the engine reported for the same requests, and
  their prompt tokens (each counted when the engine's usage arrives, so the three cover the
  same requests); totals are their ``sum()``;
* routing decisions by role and reason (affinity, load, hot_spot, round_robin, random);
* the index, per model, read at each scrape: blocks, (block, worker) entries, estimated bytes,
  its cap, blocks evicted for the cap;
* each worker's cache stream, read at each scrape: whether it is live, updates applied, gaps
  and resyncs, and whether its keys follow another layout than this frontend's;
* each worker's events lag, observed as its deltas are applied: this frontend's clock minus
  the engine's time of the batch the delta came from (``KvCacheDelta.engine_time``).

A worker's series go when it leaves the set (:meth:`RoutingMetrics.forget_worker`, and the
scrape-time families simply stop listing it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar_common.histograms import LATENCY_BUCKETS
from sidecar_frontend.routing.index import BlockIndex

__all__ = ["RoutingMetrics", "StreamRow"]


@dataclass(frozen=True)
class StreamRow:
    """One worker's cache stream as the scrape shows it."""

    worker: str
    model: str
    live: bool
    engine_publishes: bool
    deltas: int
    gaps: int
    resyncs: int
    # Its snapshot's keys follow another layout than this frontend's (nothing of it indexed).
    foreign_keys: bool = False


class _RoutingCollector(Collector):
    def __init__(
        self,
        indexes: Callable[[], Mapping[str, BlockIndex]],
        streams: Callable[[], list[StreamRow]],
        max_bytes: int | None,
    ) -> None:
        self._indexes = indexes
        self._streams = streams
        self._max_bytes = max_bytes

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "frontend_kv_index_blocks", "Distinct KV blocks indexed, by model", labels=["model"]
        )
        entries = GaugeMetricFamily(
            "frontend_kv_index_entries", "(block, worker) pairs indexed, by model", labels=["model"]
        )
        size = GaugeMetricFamily(
            "frontend_kv_index_bytes", "The index's estimated memory, by model", labels=["model"]
        )
        evicted = CounterMetricFamily(
            "frontend_kv_index_evicted_blocks",
            "Blocks evicted from the index for its memory cap, by model",
            labels=["model"],
        )
        for model, index in sorted(self._indexes().items()):
            stats = index.stats()
            blocks.add_metric([model], stats.keys)
            entries.add_metric([model], stats.entries)
            size.add_metric([model], stats.bytes)
            evicted.add_metric([model], stats.evicted)
        yield from (blocks, entries, size, evicted)
        if self._max_bytes is not None:
            cap = GaugeMetricFamily(
                "frontend_kv_index_max_bytes", "The memory cap of each model's index (--routing-index-max-mb)"
            )
            cap.add_metric([], self._max_bytes)
            yield cap
        live = GaugeMetricFamily(
            "frontend_kv_stream_live",
            "1 while a worker's cache stream is applied to the index (its snapshot arrived), else 0; "
            "publishing says whether its engine has published any KV event",
            labels=["worker", "model", "publishing"],
        )
        deltas = CounterMetricFamily(
            "frontend_kv_stream_updates", "Cache deltas applied, by worker", labels=["worker"]
        )
        gaps = CounterMetricFamily(
            "frontend_kv_stream_gaps",
            "Cache stream gaps (a delta missing; the stream resumed from the last one applied), by worker",
            labels=["worker"],
        )
        resyncs = CounterMetricFamily(
            "frontend_kv_stream_resyncs",
            "Cache snapshots after the first (the worker's state rebuilt from scratch), by worker",
            labels=["worker"],
        )
        foreign = GaugeMetricFamily(
            "frontend_kv_stream_foreign_keys",
            "1 while a worker's cache keys follow another layout than this frontend's "
            "(KvCacheSnapshot.key_scheme, a rolling upgrade): none is indexed and the worker is "
            "routed as one that publishes no cache state, else 0",
            labels=["worker"],
        )
        for row in sorted(self._streams(), key=lambda r: r.worker):
            live.add_metric([row.worker, row.model, str(row.engine_publishes).lower()], 1 if row.live else 0)
            deltas.add_metric([row.worker], row.deltas)
            gaps.add_metric([row.worker], row.gaps)
            resyncs.add_metric([row.worker], row.resyncs)
            foreign.add_metric([row.worker], 1 if row.foreign_keys else 0)
        yield from (live, deltas, gaps, resyncs, foreign)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.decisions = Counter(
            "frontend_routing_decisions",
            "Worker choices, by role and reason: affinity (the longest cached prefix), load (no "
            "cached prefix anywhere, or a less busy worker was worth its prefill), hot_spot (the "
            "worker holding more of the prefix was far busier than the least busy one), "
            "round_robin, random",
            ["role", "reason"],
            registry=registry,
        )
        self.predicted_cached = Counter(
            "frontend_kv_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the worker it chose (counted when the "
            "engine's usage arrives), by worker",
            ["worker"],
            registry=registry,
        )
        self.reported_cached = Counter(
            "frontend_kv_reported_cached_tokens",
            "Prompt tokens the engine reported cached (vLLM num_cached_tokens, SGLang "
            "cached_tokens), by worker",
            ["worker"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "frontend_kv_prompt_tokens",
            "Prompt tokens of the requests counted in the two cached-token counters, by worker",
            ["worker"],
            registry=registry,
        )
        # The sidecars' latency ladder, a millisecond to half a minute: a healthy fleet's lag
        # is milliseconds; past 30 s (a long-missed replay, a wrong clock) is +Inf.
        self.events_lag = Histogram(
            "frontend_kv_events_lag_seconds",
            "From the engine's time of a KV-event batch to this frontend applying the cache delta "
            "it made to the index, by worker. The engine's and this frontend's clocks differ by "
            "their hosts' skew, which this includes; a negative lag counts as 0",
            ["worker"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def watch(
        self,
        indexes: Callable[[], Mapping[str, BlockIndex]],
        streams: Callable[[], list[StreamRow]],
        max_bytes: int | None,
    ) -> None:
        """Export the indexes' and the streams' state, read at each scrape."""
        self.registry.register(_RoutingCollector(indexes, streams, max_bytes))

    def decided(self, role: str, reason: str) -> None:
        self.decisions.labels(role, reason).inc()

    def usage(self, worker: str, *, predicted: int, reported: int, prompt: int) -> None:
        """One request's usage arrived from ``worker``."""
        self.predicted_cached.labels(worker).inc(predicted)
        self.reported_cached.labels(worker).inc(reported)
        self.prompt_tokens.labels(worker).inc(prompt)

    def events_lagged(self, worker: str, seconds: float) -> None:
        """A delta from ``worker`` was applied ``seconds`` after its engine made the batch."""
        self.events_lag.labels(worker).observe(seconds)

    def forget_worker(self, worker: str) -> None:
        metrics: tuple[Counter | Histogram, ...] = (
            self.predicted_cached,
            self.reported_cached,
            self.prompt_tokens,
            self.events_lag,
        )
        for metric in metrics:
            with contextlib.suppress(KeyError):
                metric.remove(worker)
