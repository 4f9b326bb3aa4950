"""The workers' cache streams against a scripted sidecar (a grpc.aio server on loopback whose
WatchKvCache a test controls): the index follows the stream, a gap resumes from the last
update applied, a restarted history resyncs, a worker that publishes nothing is never asked, a
worker whose keys follow another layout is routed as one that publishes nothing until its
sidecar restarts, and a worker that leaves takes its entries with it."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.kv_keys import KEY_SCHEME, block_keys
from sidecar_frontend.routing.metrics import RoutingMetrics
from sidecar_frontend.routing.router import Router, RouterConfig
from sidecar_frontend.routing.streams import CacheStreams, StreamConfig
from sidecar_frontend.workers import Worker, WorkerSet
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS

pytestmark = pytest.mark.timeout(60)

FAST_STREAMS = StreamConfig(ready_check_secs=0.05, retry_first_secs=0.05, retry_max_secs=0.2)


def _snapshot(
    epoch: int, sequence: int, keys: list[int], *, last: bool = True, key_scheme: int = KEY_SCHEME
) -> sidecar_pb2.KvCacheUpdate:
    return sidecar_pb2.KvCacheUpdate(
        snapshot=sidecar_pb2.KvCacheSnapshot(
            epoch=epoch,
            sequence=sequence,
            block_size=16,
            model="m",
            keys=keys,
            parents=[0] * len(keys),
            last_chunk=last,
            status=sidecar_pb2.KvCacheStatus(subscribed=True, batches_received=1, block_size=16),
            key_scheme=key_scheme,
        )
    )


def _delta(
    epoch: int,
    sequence: int,
    *,
    added: tuple[int, ...] = (),
    removed: tuple[int, ...] = (),
    engine_time: float | None = None,
) -> sidecar_pb2.KvCacheUpdate:
    return sidecar_pb2.KvCacheUpdate(
        delta=sidecar_pb2.KvCacheDelta(
            epoch=epoch,
            sequence=sequence,
            removed=removed,
            added_keys=added,
            added_parents=[0] * len(added),
            engine_time=engine_time,
        )
    )


class CacheSidecar(sidecar_pb2_grpc.WorkerServicer, health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Serves WatchKvCache from what a test pushes: the open call sends each update in turn; a
    None ends that call (the next call goes on with what follows)."""

    def __init__(self, subscribed: bool = True) -> None:
        self.subscribed = subscribed
        self.updates: list[sidecar_pb2.KvCacheUpdate | None] = []
        self.requests: list[tuple[int | None, int | None]] = []
        self.pushed = anyio.Event()
        self._restarted = anyio.Event()

    async def GetModelInfo(self, request: Any, context: Any) -> sidecar_pb2.ModelInfo:
        return sidecar_pb2.ModelInfo(engine="vllm", served_model_name="m", kv_block_size=16)

    async def GetLoad(self, request: Any, context: Any) -> sidecar_pb2.LoadReport:
        return sidecar_pb2.LoadReport(kv_cache=sidecar_pb2.KvCacheStatus(subscribed=self.subscribed))

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        await self._restarted.wait()

    def restart(self) -> None:
        """End the health Watch, as a sidecar's restart does (the frontend checks it again)."""
        self._restarted.set()
        self._restarted = anyio.Event()

    async def WatchKvCache(self, request: Any, context: Any) -> AsyncIterator[sidecar_pb2.KvCacheUpdate]:
        self.requests.append(
            (
                request.epoch if request.HasField("epoch") else None,
                request.sequence if request.HasField("sequence") else None,
            )
        )
        while True:
            while not self.updates:
                pushed = self.pushed = anyio.Event()
                await pushed.wait()
            update = self.updates.pop(0)
            if update is None:
                return
            yield update

    def push(self, *updates: sidecar_pb2.KvCacheUpdate | None) -> None:
        self.updates.extend(updates)
        self.pushed.set()


@asynccontextmanager
async def serving(sidecar: CacheSidecar) -> AsyncIterator[str]:
    server = grpc.aio.server()
    sidecar_pb2_grpc.add_WorkerServicer_to_server(sidecar, server)
    health_pb2_grpc.add_HealthServicer_to_server(sidecar, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@asynccontextmanager
async def following(
    router: Router, *, metrics: RoutingMetrics | None = None, clock: Callable[[], float] = time.time
) -> AsyncIterator[tuple[WorkerSet, CacheStreams]]:
    streams = CacheStreams(router, config=FAST_STREAMS, metrics=metrics, clock=clock)
    async with WorkerSet(FAST_WORKERS) as workers:
        streams.watch_changes(workers.next_change, workers.misbehaviour)

        class _Follow:
            def joined(self, worker: Worker) -> None:
                workers.supervisor.start("kv_stream", lambda: streams.follow(worker), owner=worker.address)

            def changed(self, worker: Worker) -> None:
                pass

            def left(self, worker: Worker) -> None:
                pass

        workers.events.subscribe(_Follow())
        yield workers, streams


def _router() -> Router:
    return Router(RouterConfig(), block_keys, random.Random(0))


async def test_the_index_follows_a_workers_stream_and_resumes_after_a_gap() -> None:
    sidecar = CacheSidecar()
    router = _router()
    sidecar.push(_snapshot(5, 10, [1, 2], last=False), _snapshot(5, 10, [3]), _delta(5, 11, added=(4,)))
    async with serving(sidecar) as address, following(router) as (workers, streams):
        workers.add_worker(address)
        index = router.index("m")
        await until(lambda: index.held(address) == {1, 2, 3, 4}, "snapshot and delta applied")
        assert streams.publishes(address)
        assert streams.block_size(address) == 16
        # Sequence 12 is lost: 13 is a gap, so the stream is asked again from (5, 11).
        sidecar.push(_delta(5, 13, removed=(1,)))
        await until(lambda: len(sidecar.requests) == 2, "watched again")
        assert sidecar.requests == [(None, None), (5, 11)]
        assert index.held(address) == {1, 2, 3, 4}  # nothing of the gap applied
        sidecar.push(_delta(5, 12, added=(7,)), _delta(5, 13, removed=(1,)))
        await until(lambda: index.held(address) == {2, 3, 4, 7}, "the gap filled on resuming")
        (row,) = streams.rows()
        assert (row.live, row.gaps, row.deltas) == (True, 1, 3)


async def test_each_delta_applied_observes_the_lag_of_its_engines_batch() -> None:
    sidecar = CacheSidecar()
    router = _router()
    metrics = RoutingMetrics(CollectorRegistry())
    now = 1_700_000_000.0
    sidecar.push(
        _snapshot(5, 10, [1]),
        _delta(5, 11, added=(2,), engine_time=now - 0.25),
        _delta(5, 12, added=(3,), engine_time=now + 0.5),  # the engine's clock runs ahead
        _delta(5, 13, added=(4,)),  # no time: a resync, or an older sidecar
        _delta(5, 13, added=(4,), engine_time=now - 9.0),  # a duplicate: not applied
    )
    async with (
        serving(sidecar) as address,
        following(router, metrics=metrics, clock=lambda: now) as (
            workers,
            _,
        ),
    ):
        workers.add_worker(address)
        await until(lambda: router.index("m").held(address) == {1, 2, 3, 4}, "deltas applied")
        sidecar.push(_delta(5, 14, added=(5,), engine_time=now - 0.004))
        await until(lambda: 5 in router.index("m").held(address), "the last delta applied")
        get = metrics.registry.get_sample_value
        worker = {"worker": address}
        assert get("frontend_kv_events_lag_seconds_count", worker) == 3
        assert get("frontend_kv_events_lag_seconds_sum", worker) == pytest.approx(0.254)
        assert get("frontend_kv_events_lag_seconds_bucket", {**worker, "le": "0.001"}) == 1  # the clamped 0
        assert get("frontend_kv_events_lag_seconds_bucket", {**worker, "le": "0.005"}) == 2


async def test_a_new_history_resyncs_from_its_snapshot() -> None:
    sidecar = CacheSidecar()
    router = _router()
    sidecar.push(_snapshot(1, 0, [1, 2, 3]), None, _snapshot(2, 0, [9]))  # a new history
    async with serving(sidecar) as address, following(router) as (workers, streams):
        workers.add_worker(address)
        index = router.index("m")
        await until(lambda: index.held(address) == {9}, "the new snapshot replaced the old state")
        assert sidecar.requests[1] == (1, 0)
        (row,) = streams.rows()
        assert row.resyncs == 1


async def test_a_worker_whose_sidecar_does_not_subscribe_is_not_watched() -> None:
    quiet, loud = CacheSidecar(subscribed=False), CacheSidecar()
    loud.push(_snapshot(1, 0, [1]))
    router = _router()
    async with (
        serving(quiet) as quiet_address,
        serving(loud) as loud_address,
        following(router) as (workers, streams),
    ):
        workers.add_worker(quiet_address)
        workers.add_worker(loud_address)
        await until(lambda: router.index("m").held(loud_address) == {1}, "the publishing worker followed")
        await until(lambda: len(workers.serving()) == 2, "both serve")
        assert quiet.requests == []
        assert not streams.publishes(quiet_address)


async def test_a_worker_that_leaves_takes_its_entries() -> None:
    sidecar = CacheSidecar()
    sidecar.push(_snapshot(1, 0, [1, 2]))
    router = _router()
    async with serving(sidecar) as address, following(router) as (workers, streams):
        workers.add_worker(address)
        index = router.index("m")
        await until(lambda: index.held(address) == {1, 2}, "followed")
        workers.drain_worker(address)
        await until(lambda: address not in index.workers(), "its entries gone")
        assert streams.rows() == []


async def test_a_worker_whose_keys_follow_another_layout_is_routed_as_one_that_publishes_nothing() -> None:
    """A rolling upgrade of sidecar_common.kv_keys: a sidecar restarted on another key layout
    sends keys no request of this frontend can match. Its entries go, nothing of it is indexed,
    one warning names it and both layouts, and once its sidecar restarts on this frontend's
    layout it is followed again."""
    sidecar = CacheSidecar()
    other = KEY_SCHEME + 1
    sidecar.push(_snapshot(1, 0, [1, 2]), None, _snapshot(2, 0, [9], key_scheme=other))
    router = _router()
    with structlog.testing.capture_logs() as logs:
        async with serving(sidecar) as address, following(router) as (workers, streams):
            workers.add_worker(address)
            index = router.index("m")
            await until(lambda: [r.foreign_keys for r in streams.rows()] == [True], "the other layout seen")
            assert index.held(address) == set()
            assert not streams.publishes(address)
            (row,) = streams.rows()
            assert not row.live
            # Asked again only after its sidecar restarts, which now sends this frontend's layout.
            sidecar.push(_snapshot(3, 0, [7]))
            sidecar.restart()
            await until(lambda: index.held(address) == {7}, "followed again after the restart")
            assert streams.publishes(address)
            assert [r.foreign_keys for r in streams.rows()] == [False]
            assert sidecar.requests == [(None, None), (1, 0), (None, None)]
    warnings = [e for e in logs if e["log_level"] == "warning" and "layout" in e["event"]]
    assert [(w["worker"], w["worker_key_scheme"], w["frontend_key_scheme"]) for w in warnings] == [
        (address, other, KEY_SCHEME)
    ]
