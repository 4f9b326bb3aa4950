"""Every worker's cache stream (``sidecar.v1.Worker/WatchKvCache``) feeding the router's index
(I/O; what each update does is ``feed.py``'s, pure).

One task per worker (:meth:`CacheStreams.follow`), started by the worker set beside the
worker's own tasks and cancelled with them when the worker leaves the set; its ``finally``
takes the worker's entries out of the index. The task waits until the worker serves and its
sidecar says it subscribes to its engine's KV events (``LoadReport.kv_cache.subscribed``, from
the worker set's load poll); then it watches, and after the stream breaks or shows a gap it
watches again from the last (epoch, sequence) applied: the sidecar resumes there or sends a
new snapshot. A worker that keeps failing is retried at the project's backoff (doubling,
capped, jittered: ``sidecar_common.retry.Backoff``). A sidecar too old to serve the stream
(UNIMPLEMENTED), and one whose keys follow another layout than this frontend's
(``KvCacheSnapshot.key_scheme``: a rolling upgrade of ``sidecar_common.kv_keys``), are not asked
again until they restart; meanwhile the worker is routed as one that publishes no cache state,
and the second is named in one warning.

Each delta applied whose sidecar sent the engine's time of its batch is observed in
``frontend_kv_events_lag_seconds``: this frontend's wall clock at that moment minus that time.

Nothing the stream sends is trusted: an update that does not decode, a block size of 0 or past
``MAX_BLOCK_SIZE``, a snapshot of more keys than ``max_snapshot_keys`` or an update of more
than ``max_update_keys`` is the worker's misbehaviour (reported to the worker set, which takes
the worker out of routing for a while), and the stream is watched again after the backoff.
Every watch again after a failure or a gap waits for the backoff; only a stream that applied
deltas counts as healthy again (a sidecar that answers each snapshot with a gap is retried at
the capped pace, not in a loop). After a TLS rotation the stream moves to the new connections
at once, resuming where it was, as the health Watch does.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import grpc
import structlog

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_lag import events_lag
from sidecar_common.retry import Backoff
from sidecar_common.rpc import cancel_is_ours
from sidecar_frontend.config import WorkerSetConfig
from sidecar_frontend.misbehaviour import NO_REPORTS, Misbehaviour, Reporter
from sidecar_frontend.registry import Worker
from sidecar_frontend.routing.feed import CacheFeed, Step
from sidecar_frontend.routing.metrics import RoutingMetrics, StreamRow
from sidecar_frontend.routing.router import Router
from sidecar_frontend.worker_replies import MAX_BLOCK_SIZE, UNDECODABLE

__all__ = ["CacheStreams", "StreamConfig"]

log = structlog.get_logger("sidecar_frontend.routing")


@dataclass(frozen=True)
class StreamConfig:
    # How often a worker not yet ready to stream (not serving, not subscribed) is looked at
    # again, at the latest (a change of the worker set wakes it sooner).
    ready_check_secs: float = 1.0
    # Pause before watching again after the stream failed, doubling up to the cap (jittered).
    retry_first_secs: float = 0.2
    retry_max_secs: float = 10.0
    # The most keys a worker's snapshot may hold (all its chunks), and one delta (added,
    # removed and announced keys together): past either, the worker misbehaves.
    max_snapshot_keys: int = WorkerSetConfig.kv_max_snapshot_keys
    max_update_keys: int = WorkerSetConfig.kv_max_update_keys


@dataclass
class _Stream:
    worker: Worker
    feed: CacheFeed
    model: str
    # Asked again only after its sidecar restarts: it answered UNIMPLEMENTED, or its snapshot's
    # keys follow another layout (feed.foreign_scheme).
    until_restart: bool = False
    # The foreign key layout this worker was last warned about: one warning, not one at each
    # restart of a sidecar that still sends it.
    warned_scheme: int | None = None
    # Keys received in the snapshot being gathered (its chunks so far).
    snapshot_keys: int = 0


class _Refused(Exception):
    """An update the stream will not apply: the worker misbehaves."""

    def __init__(self, kind: Misbehaviour, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class CacheStreams:
    """The workers' cache streams and what the router needs to know of them."""

    def __init__(
        self,
        router: Router,
        *,
        config: StreamConfig | None = None,
        next_change: Callable[[], anyio.Event] | None = None,
        metrics: RoutingMetrics | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        misbehaviour: Reporter = NO_REPORTS,
    ) -> None:
        self._router = router
        self._config = config if config is not None else StreamConfig()
        self._next_change = next_change
        self._metrics = metrics
        self._misbehaviour = misbehaviour
        # Wall-clock time (the engines stamp their KV-event batches with time.time()): read
        # when a delta is applied, for the events lag.
        self._clock = clock
        # The router's clock (RoutedChoice's), for the expiry of announced blocks.
        self._monotonic = monotonic
        self._streams: dict[str, _Stream] = {}

    def watch_changes(
        self, next_change: Callable[[], anyio.Event], misbehaviour: Reporter | None = None
    ) -> None:
        """Wake a waiting stream at each change of the worker set (``WorkerSet.next_change``);
        report to ``misbehaviour`` a worker whose stream cannot be believed."""
        self._next_change = next_change
        if misbehaviour is not None:
            self._misbehaviour = misbehaviour

    # ---------------------------------------------------------------- what routing reads

    def publishes(self, address: str) -> bool:
        """Whether ``address``'s entries in the index come from its engine's events: its
        stream's snapshot arrived and its engine has published at least once."""
        stream = self._streams.get(address)
        return stream is not None and stream.feed.live and stream.feed.engine_publishes

    def block_size(self, address: str) -> int:
        """The block size ``address``'s stream reported (0: none yet)."""
        stream = self._streams.get(address)
        return 0 if stream is None else stream.feed.block_size

    def rows(self) -> list[StreamRow]:
        return [
            StreamRow(
                address,
                stream.model,
                stream.feed.live,
                stream.feed.engine_publishes,
                stream.feed.counts.deltas,
                stream.feed.counts.gaps,
                stream.feed.counts.resyncs,
                foreign_keys=stream.feed.foreign_scheme is not None,
            )
            for address, stream in self._streams.items()
        ]

    # ---------------------------------------------------------------- the per-worker task

    async def follow(self, worker: Worker) -> None:
        """Watch ``worker``'s cache for as long as it is in the set (a worker set companion)."""
        backoff = Backoff(self._config.retry_first_secs, self._config.retry_max_secs)
        failures = 0  # in a row, since the stream last applied anything
        try:
            while True:
                stream = await self._ready(worker)
                counts = stream.feed.counts
                deltas = counts.deltas
                failure = await self._watch(stream)
                # Healthy again only once it applied deltas: a snapshot alone followed by a
                # gap, again and again, is a loop to slow down, not progress.
                if counts.deltas != deltas:
                    failures = 0
                if failure is None:
                    continue
                failures += 1
                pause = backoff.pause(failures)
                if failure == _GAP:
                    if failures == GAPS_BEFORE_STORM:
                        self._misbehaviour.report(
                            worker.address,
                            Misbehaviour.KV_RESYNC_STORM,
                            f"{failures} gaps in a row with no delta applied between them",
                        )
                    await anyio.sleep(pause if failures > 1 else 0.0)
                    continue
                if failures == 1:
                    # Once per series of failures; the snapshot line says when it is over.
                    log.warning(
                        "worker cache stream failed, watching again",
                        worker=worker.address,
                        error=failure,
                        retry_in_secs=round(pause, 2),
                    )
                await anyio.sleep(pause)
        finally:
            # The same address may already be back as a new worker with a stream of its own.
            ended = self._streams.get(worker.address)
            if ended is not None and ended.worker is worker:
                del self._streams[worker.address]
                ended.feed.stop()

    async def _ready(self, worker: Worker) -> _Stream:
        """Until ``worker`` serves, its sidecar subscribes to its engine's events and has not
        refused the stream: its stream (a new one, on a fresh index, when its model changed)."""
        while True:
            changed = self._next_change() if self._next_change is not None else None
            stream = self._streams.get(worker.address)
            model = worker.served_model
            if stream is not None and stream.worker is not worker:
                # A worker that left under this address, its task not yet ended: its stream goes.
                stream.feed.stop()
                stream = None
                del self._streams[worker.address]
            if stream is not None and stream.model != model and model:
                stream.feed.stop()
                stream = None
                del self._streams[worker.address]
            if worker.model is None and stream is not None:
                stream.until_restart = False  # its sidecar restarted: ask again
            if worker.eligible and model and worker.publishes_cache:
                if stream is None:
                    feed = CacheFeed(worker.address, functools.partial(self._router.index, model))
                    stream = _Stream(worker, feed, model)
                    self._streams[worker.address] = stream
                if not stream.until_restart:
                    return stream
            with anyio.move_on_after(self._config.ready_check_secs):
                if changed is not None:
                    await changed.wait()
                else:
                    await anyio.sleep(self._config.ready_check_secs)

    async def _watch(self, stream: _Stream) -> str | None:
        """One WatchKvCache call on the worker's current connections, until it breaks, shows
        a gap or the connections are replaced; why it failed (``_GAP`` for a gap; None: the
        connections were replaced, or a sidecar that does not serve the stream)."""
        with stream.worker.on_current_connections() as moved:
            failure = await self._watch_once(stream)
        return None if moved.cancelled_caught else failure

    async def _watch_once(self, stream: _Stream) -> str | None:
        feed = stream.feed
        worker = stream.worker
        request = sidecar_pb2.WatchKvCacheRequest()
        resume = feed.resume_from
        if resume is not None:
            request.epoch, request.sequence = resume
        stream.snapshot_keys = 0
        try:
            call = worker.stub().WatchKvCache(request)
            try:
                async for update in _updates(call):
                    try:
                        step = self._apply(stream, update)
                    except _Refused as refused:
                        self._misbehaviour.report(worker.address, refused.kind, str(refused))
                        return f"refused an update: {refused}"
                    if step is Step.GAP:
                        log.info(
                            "worker cache stream gap: resuming",
                            worker=worker.address,
                            resume_from=feed.resume_from,
                        )
                        return _GAP
                    if step is Step.FOREIGN:
                        stream.until_restart = True
                        self._foreign(stream)
                        return None
                    if step is Step.SNAPSHOT:
                        log.info(
                            "worker cache snapshot",
                            worker=worker.address,
                            model=stream.model,
                            blocks=feed.index.blocks_of(worker.address),
                            block_size=feed.block_size,
                            resyncs=feed.counts.resyncs,
                        )
            finally:
                call.cancel()
        except grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            if code is grpc.StatusCode.UNIMPLEMENTED:
                stream.until_restart = True
                log.warning(
                    "worker cache stream not served by its sidecar: routing it without its cache",
                    worker=worker.address,
                )
                return None
            details = err.details() if callable(getattr(err, "details", None)) else None
            return f"{details or 'no details'} ({code.name if code is not None else 'no status'})"
        except asyncio.CancelledError:
            if cancel_is_ours():
                raise
            return "the call was cancelled under us (its connection closed)"
        return "the sidecar ended the stream"  # it is going away

    def _foreign(self, stream: _Stream) -> None:
        """Warn once per worker (and layout) that its keys follow another layout."""
        feed = stream.feed
        if feed.foreign_scheme is None or feed.foreign_scheme == stream.warned_scheme:
            return
        stream.warned_scheme = feed.foreign_scheme
        log.warning(
            "worker cache keys follow another layout than this frontend's: routing it as a worker "
            "that publishes no cache state until its sidecar restarts",
            worker=stream.worker.address,
            worker_key_scheme=feed.foreign_scheme,
            frontend_key_scheme=feed.key_scheme,
        )

    def _apply(self, stream: _Stream, update: sidecar_pb2.KvCacheUpdate | None) -> Step:
        """Check one update at the edge (raises :class:`_Refused`), then feed it."""
        if update is None:
            raise _Refused(Misbehaviour.UNDECODABLE_KV, UNDECODABLE)
        feed = stream.feed
        config = self._config
        kind = update.WhichOneof("update")
        if kind == "snapshot":
            snap = update.snapshot
            if not 0 < snap.block_size <= MAX_BLOCK_SIZE:
                raise _Refused(
                    Misbehaviour.ABSURD_KV,
                    f"a snapshot with block size {snap.block_size}, not within [1, {MAX_BLOCK_SIZE}]",
                )
            stream.snapshot_keys += len(snap.keys)
            if stream.snapshot_keys > config.max_snapshot_keys:
                raise _Refused(
                    Misbehaviour.ABSURD_KV, f"a snapshot of more than {config.max_snapshot_keys} keys"
                )
            if snap.last_chunk:
                stream.snapshot_keys = 0
            return feed.snapshot_chunk(
                snap.epoch,
                snap.sequence,
                snap.block_size,
                snap.keys,
                last_chunk=snap.last_chunk,
                engine_published=snap.status.batches_received > 0,
                key_scheme=snap.key_scheme,
            )
        if kind == "delta":
            delta = update.delta
            size = len(delta.removed) + len(delta.added_keys) + len(delta.announced_keys)
            if size > config.max_update_keys:
                raise _Refused(
                    Misbehaviour.ABSURD_KV, f"a delta of {size} keys, more than {config.max_update_keys}"
                )
            step = feed.delta(
                delta.epoch,
                delta.sequence,
                cleared=delta.cleared,
                removed=delta.removed,
                added=delta.added_keys,
                announced=delta.announced_keys,
                now=self._monotonic(),
            )
            if step is Step.APPLIED and delta.HasField("engine_time") and self._metrics is not None:
                self._metrics.events_lagged(feed.worker, events_lag(self._clock(), delta.engine_time))
            return step
        return Step.DUPLICATE  # an update kind this frontend does not know: nothing to apply


_GAP = "a gap in the stream"
# Gaps in a row, with no delta applied between them, that make a resync storm (misbehaviour).
GAPS_BEFORE_STORM = 5


async def _updates(call: Any) -> AsyncIterator[sidecar_pb2.KvCacheUpdate]:
    # grpc.aio's stream calls are async iterables, but the stubs are not typed as such.
    async for update in call:
        yield update
