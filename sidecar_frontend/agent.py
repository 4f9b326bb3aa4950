"""One worker's agent: the I/O that keeps the registry's view of one sidecar true.

Per worker, two supervised tasks (:mod:`sidecar_frontend.supervisor`), each restarted after a
failure and cancelled when the worker leaves the set:

- ``health``: dial the worker's channels, then a ``grpc.health.v1`` Watch on
  ``sidecar.v1.Worker``; each SERVING it says is checked once against the worker's
  ``ModelInfo`` (fetched once each time the worker comes to serve; its role and model must be
  usable, or the worker is refused). When the Watch breaks the worker is NOT_SERVING and
  watched again, after a pause that doubles while it keeps breaking.
- ``load_poll``: the worker's load (other frontends' requests, the engine's running and
  waiting requests and KV-cache use, whether its sidecar relays KV events), pushed by its
  sidecar on ``WatchLoad`` as it changes (watched again after the stream breaks, after a pause
  that doubles up to ``load_poll_interval`` while it keeps breaking). A sidecar older than
  WatchLoad (UNIMPLEMENTED) is polled with ``GetLoad`` every ``load_poll_interval`` instead,
  until it restarts (the frontend then holds another ModelInfo for it), when WatchLoad is
  asked again. Each report sets the worker's figures and ``load_reported_at``, and its
  engine's state (running, paused) and weight version (``fleet.py``: a paused worker takes no
  new request; with ``--route-latest-weights`` nor does one behind the newest version).

Every reply is checked before it is believed (:mod:`sidecar_frontend.worker_replies`); a
reply that does not decode or holds absurd values (pushed or polled), and a GetLoad left
unanswered while the Watch says SERVING, is misbehaviour: reported
(:mod:`sidecar_frontend.misbehaviour`: logged once per kind and interval, counted) and the
worker is taken out of routing for a backoff. A WatchLoad stream that stays silent for
``LOAD_SILENT_HEARTBEATS`` of its sidecar's heartbeats is not: its sidecar sends nothing while
it cannot read its engine's load, so the worker's figures age (admission counts a worker whose
report is stale as saturated), a warning says so while the worker serves, and the stream is
watched again.

After a TLS rotation :meth:`WorkerAgent.redial` replaces the connections: new calls, the
health Watch, the load stream and the KV stream move to the new ones; calls in flight on the
old ones finish there (closed at most ``retire_grace`` later).
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.pool import ChannelPool, Deadline, PoolConfig, ReportSchedule
from sidecar_common.retry import Backoff
from sidecar_common.rpc import StubCache, bounded_call, call_failures, cancel_is_ours
from sidecar_common.tls import ClientCredentials, TlsHandshakeError, tls_connector
from sidecar_frontend.config import WorkerSetConfig
from sidecar_frontend.misbehaviour import Misbehaviour, Reporter
from sidecar_frontend.registry import Refusal, Registry, Worker, WorkerState
from sidecar_frontend.supervisor import Supervisor
from sidecar_frontend.worker_replies import (
    UNDECODABLE,
    engine_load,
    engine_state,
    load_problem,
    model_info_problem,
)

__all__ = [
    "HEALTH_SERVICE",
    "LOAD_HEARTBEAT_SECS",
    "LOAD_SILENT_HEARTBEATS",
    "WorkerAgent",
    "new_pool",
    "worker_stub",
]

HEALTH_SERVICE = "sidecar.v1.Worker"
# WatchLoad's promise (docs/api.md): a report at least every second while the sidecar can read
# its engine's load.
LOAD_HEARTBEAT_SECS: Final = 1.0
# A WatchLoad stream silent for this many heartbeats is watched again (see the module doc).
LOAD_SILENT_HEARTBEATS: Final = 3

log = structlog.get_logger("sidecar_frontend.workers")


def worker_stub(channel: grpc.aio.Channel) -> sidecar_pb2_grpc.WorkerAsyncStub:
    # The generated stub's constructor answers an asyncio channel with its typed async stub.
    return sidecar_pb2_grpc.WorkerStub(channel)


def new_pool(address: str, config: WorkerSetConfig, credentials: ClientCredentials | None) -> ChannelPool:
    return ChannelPool(
        PoolConfig(
            parse_endpoint(address), connections=config.connections, retry=config.retry, peer="worker"
        ),
        connector=tls_connector(credentials) if credentials is not None else None,
    )


@dataclass
class _Unanswered:
    """A worker that keeps not answering once connected (its health Watch breaks, its
    ``GetModelInfo`` fails): reported at the pool's pace (:class:`ReportSchedule`: at once,
    then at a doubling interval up to the cap), until it answers again."""

    first: float
    cap: float
    since: float | None = None
    schedule: ReportSchedule | None = None

    def due(self, now: float) -> float | None:
        """It failed at ``now``: the interval to the next report when one is due, else None."""
        if self.schedule is None:
            self.schedule = ReportSchedule(self.first, self.cap)
            self.since = now
        return self.schedule.due(now)

    def lasted(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since

    def clear(self) -> bool:
        """It answered; whether it had been failing."""
        failing = self.schedule is not None
        self.schedule = None
        self.since = None
        return failing


@dataclass(frozen=True)
class _Unwatched:
    """Its sidecar answered WatchLoad UNIMPLEMENTED while the frontend held ``model`` for it:
    polled until the frontend holds another (the sidecar restarted, maybe upgraded)."""

    model: sidecar_pb2.ModelInfo | None


@dataclass(frozen=True)
class _LoadStreamEnd:
    """How one WatchLoad call ended: why (None: its sidecar does not serve WatchLoad), how many
    reports it delivered that were believed, and whether one was refused as misbehaviour."""

    why: str | None
    believed: int = 0
    refused: bool = False


class _Verdict(enum.Enum):
    SERVES = "serves"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # GetModelInfo failed or was refused: not SERVING yet, asked again


class WorkerAgent:
    """The tasks that follow one worker (started by the worker set, one agent per worker)."""

    def __init__(
        self,
        worker: Worker,
        registry: Registry,
        supervisor: Supervisor,
        config: WorkerSetConfig,
        *,
        credentials: ClientCredentials | None,
        set_state: Callable[[Worker, WorkerState], None],
        refuse: Callable[[Worker, Refusal, str], None],
        misbehaviour: Reporter,
        announce_model: Callable[[Worker, sidecar_pb2.ModelInfo], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self._registry = registry
        self._supervisor = supervisor
        self._config = config
        self._credentials = credentials
        self._set_state = set_state
        self._refuse = refuse
        self._misbehaviour = misbehaviour
        self._announce_model = announce_model
        self._clock = clock
        self._connected = False
        self._report = _Unanswered(config.report_first_secs, config.report_max_secs)
        # Silent WatchLoad streams of a serving worker: warned of at the same pace.
        self._load_silence = _Unanswered(config.report_first_secs, config.report_max_secs)
        self._unwatched: _Unwatched | None = None

    def start(self) -> None:
        address = self.worker.address
        self._supervisor.start("health", self._health, owner=address)
        self._supervisor.start("load_poll", self._follow_load, owner=address)

    # ---------------------------------------------------------------- health

    async def _health(self) -> None:
        try:
            if not self._connected:
                await self._connect()
                self._connected = True
            await self._watch_health()
        except BaseException:
            if not cancel_is_ours():
                # A failure (the supervisor runs the task again): its state is unknown until
                # the Watch says it anew.
                self._set_state(self.worker, WorkerState.NOT_SERVING)
            raise

    async def _connect(self) -> None:
        """Until the worker's channels are up. While it does not answer, the pool says where
        it dials and why it fails (`waiting for worker`, at once, then at a doubling interval);
        each round that runs out is one more line here."""
        worker = self.worker
        refused_pause, refused_cap = self._config.tls_refused_retry
        began = self._clock()
        failed = False
        while True:
            version = self._credentials.version if self._credentials is not None else 0
            try:
                await worker.pool.connect(Deadline.start(worker.pool.clock, self._config.connect_round_secs))
                worker.tls_version = version
            except TlsHandshakeError as err:
                # Not eligible until a handshake succeeds (a certificate being reissued);
                # the other workers serve meanwhile.
                log.error(
                    "worker refused: TLS handshake failed",
                    worker=worker.address,
                    error=str(err),
                    retry_in_secs=refused_pause,
                )
                await anyio.sleep(refused_pause)
                refused_pause = min(refused_pause * 2, refused_cap)
                continue
            except SidecarError as err:
                failed = True
                log.warning(
                    "worker unreachable, dialling again",
                    worker=worker.address,
                    dialling=worker.pool.config.endpoint.target,
                    error=err.message,
                    waited_secs=round(self._clock() - began, 1),
                )
                continue
            if failed:
                log.info(
                    "worker answering", worker=worker.address, waited_secs=round(self._clock() - began, 1)
                )
            return

    async def _watch_health(self) -> None:
        worker = self.worker
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        backoff = Backoff(self._config.rewatch_interval, self._config.report_max_secs)
        breaks = 0  # in a row, since a Watch last said SERVING
        while True:
            with worker.on_current_connections() as rewatch:
                why, served = await self._watch_once(request)
            if rewatch.cancelled_caught:
                continue  # new connections (TLS files rotated): watch there, state kept
            breaks = 0 if served else breaks + 1
            log.debug("health watch ended", worker=worker.address, why=why)
            # Checked again once it serves: a restarted worker may serve another model, or
            # have had its disaggregation mode fixed.
            self._registry.forget_model(worker)
            self._set_state(worker, WorkerState.NOT_SERVING)
            await anyio.sleep(backoff.pause(max(breaks, 1)))

    async def _watch_once(self, request: health_pb2.HealthCheckRequest) -> tuple[str, bool]:
        """One health Watch on the worker's connections, until it breaks: why it ended, and
        whether it said SERVING at least once."""
        worker = self.worker
        why = "its health Watch ended"
        served = False
        try:
            stub = health_pb2_grpc.HealthStub(worker.pool.channel())
            call = stub.Watch(request)
            try:
                with call_failures("Watch"):
                    async for reply in _responses(call):
                        if reply is None:
                            self._misbehaviour.report(
                                worker.address, Misbehaviour.UNDECODABLE_HEALTH, UNDECODABLE
                            )
                            return f"health Watch: {UNDECODABLE}", served
                        if reply.status != health_pb2.HealthCheckResponse.SERVING:
                            if worker.state is not WorkerState.REFUSED:
                                self._set_state(worker, WorkerState.NOT_SERVING)
                            continue
                        served = True
                        verdict = await self._check_model()
                        if verdict is _Verdict.UNKNOWN:
                            return "GetModelInfo failed", served  # a fresh Watch restates SERVING
                        if self._report.clear():
                            log.info("worker answering", worker=worker.address)
                        if verdict is _Verdict.SERVES:
                            self._set_state(worker, WorkerState.SERVING)
            finally:
                call.cancel()
        except SidecarError as err:
            why = err.message
            self._unanswered("worker not answering", why)
        return why, served

    def _unanswered(self, event: str, why: str) -> None:
        next_report = self._report.due(self._clock())
        if next_report is not None:
            log.warning(
                event,
                worker=self.worker.address,
                dialling=self.worker.pool.config.endpoint.target,
                error=why,
                waited_secs=round(self._report.lasted(self._clock()), 1),
                next_report_secs=next_report,
            )

    async def _check_model(self) -> _Verdict:
        """Fetch the worker's ModelInfo once; refuse it when its role or model cannot be
        used."""
        worker = self.worker
        model = worker.model
        if model is None:
            try:
                fetched: sidecar_pb2.ModelInfo | None = await bounded_call(
                    "GetModelInfo",
                    self._config.rpc_timeout,
                    lambda t: worker.stub().GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=t),
                )
            except SidecarError as err:
                self._unanswered("worker model info failed", err.message)
                return _Verdict.UNKNOWN
            if fetched is None:
                self._misbehaviour.report(worker.address, Misbehaviour.UNDECODABLE_MODEL_INFO, UNDECODABLE)
                return _Verdict.UNKNOWN
            problem = model_info_problem(fetched)
            if problem is not None:
                self._misbehaviour.report(worker.address, Misbehaviour.ABSURD_MODEL_INFO, problem)
                return _Verdict.UNKNOWN
            model = worker.model = fetched
            self._announce_model(worker, model)
        if worker.state is WorkerState.REFUSED:
            return _Verdict.REFUSED
        refusal = self._registry.refusal_for(worker, model)
        if refusal is not None:
            self._refuse(worker, refusal[0], refusal[1])
            return _Verdict.REFUSED
        return _Verdict.SERVES

    # ---------------------------------------------------------------- load

    async def _follow_load(self) -> None:
        """The worker's load, pushed while its sidecar serves WatchLoad, else polled."""
        worker = self.worker
        backoff = Backoff(self._config.rewatch_interval, self._config.load_poll_interval)
        breaks = 0  # in a row, since a stream last delivered a report that was believed
        while True:
            unwatched = self._unwatched
            if unwatched is not None and unwatched.model is worker.model:
                await self._poll_load_once()
                await anyio.sleep(self._config.load_poll_interval)
                continue
            self._unwatched = None
            with worker.on_current_connections() as moved:
                end = await self._watch_load_once()
            if moved.cancelled_caught:
                continue  # new connections (TLS files rotated): watch there
            if end.why is None:
                self._unwatched = _Unwatched(worker.model)
                log.info("worker load polled: its sidecar serves no WatchLoad", worker=worker.address)
                continue
            breaks = 0 if end.believed and not end.refused else breaks + 1
            log.debug("worker load stream ended", worker=worker.address, why=end.why)
            await anyio.sleep(backoff.pause(max(breaks, 1)))

    async def _watch_load_once(self) -> _LoadStreamEnd:
        """One WatchLoad call on the worker's current connections, until it breaks, stays silent
        for ``LOAD_SILENT_HEARTBEATS`` heartbeats, sends a report that cannot be believed, or
        turns out not to be served."""
        worker = self.worker
        silence = LOAD_HEARTBEAT_SECS * LOAD_SILENT_HEARTBEATS
        believed = 0
        try:
            call = worker.stub().WatchLoad(sidecar_pb2.WatchLoadRequest())
            try:
                with call_failures("WatchLoad"):
                    while True:
                        with anyio.move_on_after(silence) as quiet:
                            reply: object = await _read_unserved_as_none(call)
                        if quiet.cancelled_caught:
                            self._silent(silence)
                            return _LoadStreamEnd(f"no report in {silence:g}s", believed)
                        if reply is _UNSERVED:
                            return _LoadStreamEnd(None, believed)
                        if reply is not None and not isinstance(reply, sidecar_pb2.LoadReport):
                            # grpc.aio's EOF (its stubs do not name it).
                            return _LoadStreamEnd("the sidecar ended the stream", believed)
                        if not self._believe_load(reply, worker.inflight):
                            return _LoadStreamEnd("refused a report", believed, refused=True)
                        believed += 1
                        if self._load_silence.clear():
                            log.info("worker load reports resumed", worker=worker.address)
            finally:
                call.cancel()
        except SidecarError as err:
            return _LoadStreamEnd(err.message, believed)

    def _silent(self, seconds: float) -> None:
        """A stream said nothing for ``seconds``: warned of (at the pace of unanswered calls)
        while the worker serves; its figures age meanwhile."""
        worker = self.worker
        if worker.state is not WorkerState.SERVING:
            return
        next_report = self._load_silence.due(self._clock())
        if next_report is not None:
            log.warning(
                "worker load reports stopped: its load is stale until they resume",
                worker=worker.address,
                silent_secs=seconds,
                waited_secs=round(self._load_silence.lasted(self._clock()), 1),
                next_report_secs=next_report,
            )

    async def _poll_load_once(self) -> None:
        """One GetLoad, for a sidecar that serves no WatchLoad."""
        worker = self.worker
        own = worker.inflight
        try:
            report: sidecar_pb2.LoadReport | None = await bounded_call(
                "GetLoad",
                self._config.rpc_timeout,
                lambda t: worker.stub().GetLoad(sidecar_pb2.GetLoadRequest(), timeout=t),
            )
        except SidecarError as err:
            # Unreachable workers are the health Watch's to report; a worker that answers
            # its Watch but leaves GetLoad unanswered (hung) misbehaves.
            if worker.state is WorkerState.SERVING and err.reason is FailureReason.CONNECTION_TIMEOUT:
                self._misbehaviour.report(worker.address, Misbehaviour.HUNG_LOAD, err.message)
            else:
                log.debug("worker load poll failed", worker=worker.address, error=err.message)
        else:
            self._believe_load(report, own)

    def _believe_load(self, report: sidecar_pb2.LoadReport | None, own: int) -> bool:
        """Check ``report`` (None: it did not decode) at the edge: the worker's figures from it,
        with ``own`` (this frontend's generations there when it arrived), or its misbehaviour
        reported. Whether it was believed."""
        worker = self.worker
        problem = UNDECODABLE if report is None else load_problem(report)
        if problem is not None or report is None:
            kind = Misbehaviour.UNDECODABLE_LOAD if report is None else Misbehaviour.ABSURD_LOAD
            self._misbehaviour.report(worker.address, kind, problem or UNDECODABLE)
            return False
        figures = engine_load(report)
        worker.reported_inflight = report.inflight_requests
        worker.own_at_report = own
        worker.publishes_cache = report.kv_cache.subscribed
        worker.running_requests = figures.running_requests
        worker.waiting_requests = figures.waiting_requests
        worker.kv_usage = figures.kv_usage
        worker.load_reported_at = self._clock()
        state, version = engine_state(report)
        self._registry.report_engine(worker, state, version)
        # After the engine's state: a report that frees room is looked at with it.
        self._registry.events.loaded(worker)
        return True

    # ---------------------------------------------------------------- TLS rotation

    async def redial(self, version: int) -> None:
        """New connections with the current TLS files; once they are up, new calls, the
        health Watch and the KV stream use them, and calls in flight on the old connections
        finish there (closed when they end, at most ``retire_grace`` later)."""
        worker = self.worker
        pool = new_pool(worker.address, self._config, self._credentials)
        try:
            await pool.connect(Deadline.start(pool.clock, self._config.redial_secs))
        except (SidecarError, TlsHandshakeError) as err:
            await pool.close()
            log.warning(
                "worker kept on its connections: dialling with the new TLS files failed",
                worker=worker.address,
                error=str(err) if isinstance(err, TlsHandshakeError) else err.message,
            )
            return
        if worker.state is WorkerState.DRAINING or not self._registry.holds(worker):
            await pool.close()
            return
        old = worker.replace_connections(pool, StubCache(pool, worker_stub), version)
        log.info("worker reconnected with the new TLS files", worker=worker.address)
        self._registry.changed(worker)
        grace = self._config.retire_grace
        # Not one of the worker's own tasks: its old connections are closed even if it leaves first.
        self._supervisor.start(
            "retire",
            lambda: old.close(grace),
            owner=f"retire {worker.address}",
            worker=worker.address,
            restart=False,
        )


# What _read_unserved_as_none returns for a sidecar that does not serve the RPC.
_UNSERVED: Final = object()


async def _read_unserved_as_none(call: Any) -> object:
    """The stream's next message (None: it did not decode; ``grpc.aio.EOF``: the stream ended),
    or ``_UNSERVED`` when the sidecar answers UNIMPLEMENTED; any other failure raises."""
    try:
        reply: object = await call.read()
    except grpc.RpcError as err:
        code = err.code() if callable(getattr(err, "code", None)) else None
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return _UNSERVED
        raise
    return reply


async def _responses(call: Any) -> AsyncIterator[Any]:
    # grpc.aio's stream calls are async iterables, but the stubs are not typed as such.
    async for reply in call:
        yield reply
