"""The worker set: the sidecars this frontend sends generations to.

One :class:`Worker` per sidecar address: its own channel pool, a ``grpc.health.v1`` Watch on
``sidecar.v1.Worker`` (a worker is eligible only while that says SERVING), its model checked
against the set's (the first worker to answer ``GetModelInfo`` fixes the model; a worker that
serves another one is refused with one log line), and its ``GetLoad`` polled on a bounded
interval. Choice is the power of two choices over a load score (see :meth:`Worker.score`).

With ``WorkerSetConfig.tls`` every worker is dialled over TLS (mutual TLS with a client
certificate); the files are re-read when they change, and each worker's connections are
replaced by connections made with the new files (:meth:`WorkerSet._redial`; docs/frontend.md,
"TLS to the workers").

The set is also the sink of worker discovery: ``add_worker`` / ``drain_worker`` /
``addresses`` are all a discovery source (static ``--worker`` flags, etcd, DNS) needs.
Every per-worker task lives in the set's task group: ``async with WorkerSet(...)``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import anyio
import grpc
import structlog
from anyio.abc import TaskGroup
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import SidecarError
from sidecar_common.pool import ChannelPool, Deadline, PoolConfig, RetryPolicy
from sidecar_common.rpc import StubCache, bounded_call
from sidecar_common.tls import (
    ClientCredentials,
    ClientTlsFiles,
    TlsHandshakeError,
    tls_connector,
)

__all__ = ["HEALTH_SERVICE", "Role", "Worker", "WorkerSet", "WorkerSetConfig", "WorkerState"]

HEALTH_SERVICE: Final = "sidecar.v1.Worker"

Role = Literal["agg", "prefill", "decode"]
ROLES: Final = ("agg", "prefill", "decode")

log = structlog.get_logger("sidecar_frontend.workers")


@dataclass(frozen=True)
class WorkerSetConfig:
    connections: int = 2  # gRPC channels (TCP connections) per sidecar
    rpc_timeout: float = 5.0  # GetModelInfo, GetLoad, Abort
    load_poll_interval: float = 1.0
    # One connection round; an unreachable worker is retried round after round until drained.
    connect_round_secs: float = 30.0
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(attempt_timeout=5.0, max_interval=1.0))
    # Pause before watching health again after the Watch stream broke.
    rewatch_interval: float = 0.2
    # Dial the workers over TLS with these files (None: plaintext).
    tls: ClientTlsFiles | None = None
    # How often the TLS files are looked at (a stat each) for a rotation.
    tls_check_interval: float = 5.0
    # After a rotation, how long calls in flight on the old connections may go on there.
    retire_grace: float = 3600.0
    # A worker whose TLS handshake fails is tried again after this, doubling up to the cap.
    tls_refused_retry: tuple[float, float] = (1.0, 30.0)


class _ModelCheck(enum.Enum):
    SAME = "same"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # GetModelInfo failed: not SERVING yet, asked again


class WorkerState(enum.Enum):
    CONNECTING = "connecting"
    NOT_SERVING = "not_serving"
    SERVING = "serving"
    REFUSED = "refused"  # serves another model
    DRAINING = "draining"


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    pool: ChannelPool
    stubs: StubCache[Any]
    state: WorkerState = WorkerState.CONNECTING
    model: sidecar_pb2.ModelInfo | None = None
    # The frontend's own generations on this worker (exact, updated per call).
    inflight: int = 0
    # The worker's last GetLoad (every frontend's generations) and our own count at that time.
    reported_inflight: int = 0
    own_at_report: int = 0
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    idle: anyio.Event = field(default_factory=anyio.Event)
    # The TLS files' version the pool's connections were made with (0: plaintext or none yet).
    tls_version: int = 0
    # The running health Watch; cancelled when the connections are replaced, so the watch
    # moves to the new ones without the worker leaving SERVING.
    rewatch: anyio.CancelScope | None = None

    @property
    def eligible(self) -> bool:
        return self.state is WorkerState.SERVING

    def score(self) -> int:
        """Our exact in-flight count plus what other frontends had there at the last poll
        (the report includes ours as they were then, so those are taken off)."""
        others = max(0, self.reported_inflight - self.own_at_report)
        return self.inflight + others

    def stub(self) -> Any:
        """A ``sidecar.v1.Worker`` stub on the pool's next channel."""
        return self.stubs.next()

    @contextmanager
    def lease(self, on_change: Callable[[Worker], None] | None = None) -> Iterator[None]:
        """Counts one generation as in flight on this worker for the ``with`` block."""
        if self.inflight == 0:
            self.idle = anyio.Event()
        self.inflight += 1
        if on_change is not None:
            on_change(self)
        try:
            yield
        finally:
            self.inflight -= 1
            if on_change is not None:
                on_change(self)
            if self.inflight == 0:
                self.idle.set()


class WorkerSet:
    """``async with WorkerSet(config) as workers:`` owns every worker's tasks."""

    def __init__(
        self,
        config: WorkerSetConfig | None = None,
        *,
        rand: random.Random | None = None,
        on_inflight: Callable[[Worker], None] | None = None,
    ) -> None:
        self._config = config if config is not None else WorkerSetConfig()
        self._credentials = ClientCredentials(self._config.tls) if self._config.tls is not None else None
        self._rand = rand if rand is not None else random.Random()
        self._on_inflight = on_inflight
        self._workers: dict[str, Worker] = {}
        self._model: sidecar_pb2.ModelInfo | None = None
        self._group: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._changed = anyio.Event()
        # Eligible workers by role, rebuilt on every state change (rare) so that a choice
        # costs O(1) whatever the size of the fleet.
        self._eligible: dict[str, list[Worker]] = {}

    async def __aenter__(self) -> WorkerSet:
        stack = AsyncExitStack()
        self._group = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        if self._credentials is not None:
            self._group.start_soon(self._follow_tls_files, self._credentials)
        return self

    async def __aexit__(self, *exc: object) -> None:
        group, stack = self._group, self._stack
        self._group = self._stack = None
        if group is not None:
            group.cancel_scope.cancel()
        if stack is not None:
            await stack.aclose()
        for worker in list(self._workers.values()):
            await worker.pool.close()
        self._workers.clear()

    # ---------------------------------------------------------------- the discovery sink

    def add_worker(self, address: str, role: str = "agg") -> None:
        """Start using the sidecar at ``address`` (host:port). Idempotent; a worker being
        drained stays drained (it is forgotten once idle, and may be added again then)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if address in self._workers:
            return
        if self._group is None:
            raise RuntimeError("WorkerSet is not running (use `async with`)")
        pool = self._new_pool(address)
        worker = Worker(address, role, pool, StubCache(pool, sidecar_pb2_grpc.WorkerStub))  # type: ignore[arg-type]
        worker.idle.set()
        self._workers[address] = worker
        self._group.start_soon(self._run, worker)
        log.info("worker added", worker=address, role=role)

    def drain_worker(self, address: str) -> None:
        """No new generations on ``address``; those in flight finish; then its channels are
        closed and it is forgotten."""
        worker = self._workers.get(address)
        if worker is None or worker.state is WorkerState.DRAINING or self._group is None:
            return
        worker.state = WorkerState.DRAINING
        self._group.start_soon(self._forget_when_idle, worker)
        log.info("worker draining", worker=address, inflight=worker.inflight)
        self._notify()

    def addresses(self) -> frozenset[str]:
        return frozenset(self._workers)

    # ---------------------------------------------------------------- choice

    @property
    def model(self) -> sidecar_pb2.ModelInfo | None:
        """What the workers serve (None until the first one answered GetModelInfo)."""
        return self._model

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def serving(self, role: str = "agg") -> list[Worker]:
        return [w for w in self._workers.values() if w.eligible and w.role == role]

    def routable(self) -> bool:
        """A generation can be placed: an aggregated worker, or a prefill and a decode one."""
        return bool(self.serving()) or bool(self.serving("prefill") and self.serving("decode"))

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def pick(self, role: str = "agg", exclude: frozenset[str] = frozenset()) -> Worker | None:
        """The less loaded of two serving workers drawn at random (power of two choices);
        never one that is not SERVING, never one in ``exclude``. O(1) without exclusions (the
        first attempt of every request); a retry's exclusions may cost a scan of the role."""
        pool = self._eligible.get(role, [])
        if not exclude and len(pool) >= 2:
            size = len(pool)
            first_at = self._rand.randrange(size)
            second_at = self._rand.randrange(size - 1)
            if second_at >= first_at:
                second_at += 1
            first, second = pool[first_at], pool[second_at]
            if first.eligible and second.eligible:
                return second if second.score() < first.score() else first
        candidates = [w for w in self._workers.values() if w.eligible and w.role == role]
        if exclude:
            candidates = [w for w in candidates if w.address not in exclude]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        first, second = self._rand.sample(candidates, 2)
        return second if second.score() < first.score() else first

    def next_change(self) -> anyio.Event:
        """Set at the next change of any worker's state (taken before looking, so no change
        between the look and the wait is missed)."""
        return self._changed

    async def wait_serving(self, count: int = 1, role: str = "agg") -> None:
        """Until at least ``count`` workers of ``role`` are SERVING (callers bound it)."""
        while len(self.serving(role)) < count:
            await self._changed.wait()

    # ---------------------------------------------------------------- per-worker tasks

    def _notify(self) -> None:
        eligible: dict[str, list[Worker]] = {}
        for worker in self._workers.values():
            if worker.eligible:
                eligible.setdefault(worker.role, []).append(worker)
        self._eligible = eligible
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _set_state(self, worker: Worker, state: WorkerState) -> None:
        if worker.state in (WorkerState.DRAINING, WorkerState.REFUSED) or worker.state is state:
            return
        log.info("worker state", worker=worker.address, state=state.value, was=worker.state.value)
        worker.state = state
        self._notify()

    async def _run(self, worker: Worker) -> None:
        with worker.scope:
            await self._connect(worker)
            async with anyio.create_task_group() as group:
                group.start_soon(self._poll_load, worker)
                await self._watch_health(worker, group)

    def _new_pool(self, address: str) -> ChannelPool:
        credentials = self._credentials
        return ChannelPool(
            PoolConfig(
                parse_endpoint(address), connections=self._config.connections, retry=self._config.retry
            ),
            connector=tls_connector(credentials) if credentials is not None else None,
        )

    async def _connect(self, worker: Worker) -> None:
        round_secs = self._config.connect_round_secs
        refused_pause, refused_cap = self._config.tls_refused_retry
        while True:
            version = self._credentials.version if self._credentials is not None else 0
            try:
                await worker.pool.connect(Deadline.start(worker.pool.clock, round_secs))
                worker.tls_version = version
                return
            except SidecarError as err:
                log.warning("worker unreachable, retrying", worker=worker.address, error=err.message)
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

    async def _watch_health(self, worker: Worker, group: TaskGroup) -> None:
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        while worker.state is not WorkerState.REFUSED:
            with anyio.CancelScope() as rewatch:
                worker.rewatch = rewatch
                if await self._watch_once(worker, group, request):
                    return  # refused: serves another model
            worker.rewatch = None
            if rewatch.cancelled_caught:
                continue  # new connections (TLS files rotated): watch there, state kept
            # Checked again once it serves: a restarted worker may serve another model.
            worker.model = None
            self._set_state(worker, WorkerState.NOT_SERVING)
            await anyio.sleep(self._config.rewatch_interval)

    async def _watch_once(
        self, worker: Worker, group: TaskGroup, request: health_pb2.HealthCheckRequest
    ) -> bool:
        """One health Watch on the worker's connections, until it breaks; True when the
        worker was refused."""
        try:
            stub = health_pb2_grpc.HealthStub(worker.pool.channel())
            call = stub.Watch(request)
            try:
                async for reply in _responses(call):
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self._set_state(worker, WorkerState.NOT_SERVING)
                        continue
                    verdict = await self._check_model(worker)
                    if verdict is _ModelCheck.REFUSED:
                        group.cancel_scope.cancel()
                        return True
                    if verdict is _ModelCheck.UNKNOWN:
                        break  # a fresh Watch restates SERVING, and the check runs again
                    self._set_state(worker, WorkerState.SERVING)
            finally:
                call.cancel()
        except (grpc.RpcError, SidecarError) as err:
            log.debug("health watch ended", worker=worker.address, error=repr(err))
        return False

    async def _check_model(self, worker: Worker) -> _ModelCheck:
        """Fetch the worker's ModelInfo once; refuse it when it serves another model."""
        model = worker.model
        if model is None:
            try:
                fetched: sidecar_pb2.ModelInfo = await bounded_call(
                    "GetModelInfo",
                    self._config.rpc_timeout,
                    lambda t: worker.stub().GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=t),
                )
            except SidecarError as err:
                log.warning("worker model info failed", worker=worker.address, error=err.message)
                return _ModelCheck.UNKNOWN
            model = worker.model = fetched
        if self._model is None:
            self._model = model
            log.info(
                "model",
                model=model.served_model_name,
                engine=model.engine,
                worker=worker.address,
            )
        if model.served_model_name != self._model.served_model_name:
            worker.state = WorkerState.REFUSED
            log.error(
                "worker refused: it serves another model",
                worker=worker.address,
                serves=model.served_model_name,
                expected=self._model.served_model_name,
            )
            self._notify()
            return _ModelCheck.REFUSED
        return _ModelCheck.SAME

    async def _poll_load(self, worker: Worker) -> None:
        while True:
            own = worker.inflight
            try:
                report = await bounded_call(
                    "GetLoad",
                    self._config.rpc_timeout,
                    lambda t: worker.stub().GetLoad(sidecar_pb2.GetLoadRequest(), timeout=t),
                )
                worker.reported_inflight = report.inflight_requests
                worker.own_at_report = own
            except SidecarError as err:
                log.debug("worker load poll failed", worker=worker.address, error=err.message)
            await anyio.sleep(self._config.load_poll_interval)

    # ---------------------------------------------------------------- TLS rotation

    async def _follow_tls_files(self, credentials: ClientCredentials) -> None:
        """Look at the TLS files every ``tls_check_interval``; after a change, replace each
        connected worker's connections by ones made with the new files (a worker whose
        replacement fails keeps its connections and is tried again at the next look)."""
        reported: str | None = None
        while True:
            await anyio.sleep(self._config.tls_check_interval)
            if credentials.refresh():
                log.info("worker TLS files reloaded", version=credentials.version)
            if credentials.problem != reported and credentials.problem is not None:
                log.warning(
                    "worker TLS files changed but cannot be used; keeping the previous ones",
                    error=credentials.problem,
                )
            reported = credentials.problem
            stale = [
                w
                for w in self._workers.values()
                if w.tls_version
                and w.tls_version != credentials.version
                and w.state is not WorkerState.DRAINING
            ]
            if stale:
                async with anyio.create_task_group() as group:
                    for worker in stale:
                        group.start_soon(self._redial, worker, credentials.version)

    async def _redial(self, worker: Worker, version: int) -> None:
        """New connections to ``worker`` with the current TLS files; once they are up, new
        calls and the health Watch use them, and calls in flight on the old connections
        finish there (closed when they end, at most ``retire_grace`` later)."""
        pool = self._new_pool(worker.address)
        try:
            await pool.connect(Deadline.start(pool.clock, self._config.connect_round_secs))
        except (SidecarError, TlsHandshakeError) as err:
            await pool.close()
            log.warning(
                "worker kept on its connections: dialling with the new TLS files failed",
                worker=worker.address,
                error=str(err) if isinstance(err, TlsHandshakeError) else err.message,
            )
            return
        if worker.state is WorkerState.DRAINING or self._workers.get(worker.address) is not worker:
            await pool.close()
            return
        old = worker.pool
        worker.pool = pool
        worker.stubs = StubCache(pool, sidecar_pb2_grpc.WorkerStub)
        worker.tls_version = version
        if worker.rewatch is not None:
            worker.rewatch.cancel()
        log.info("worker reconnected with the new TLS files", worker=worker.address)
        if self._group is not None:
            self._group.start_soon(old.close, self._config.retire_grace)

    async def _forget_when_idle(self, worker: Worker) -> None:
        while worker.inflight:
            await worker.idle.wait()
        worker.scope.cancel()
        await worker.pool.close()
        if self._workers.get(worker.address) is worker:
            del self._workers[worker.address]
        log.info("worker drained", worker=worker.address)
        self._notify()


async def _responses(call: Any) -> AsyncIterator[Any]:
    # grpc.aio's stream calls are async iterables, but the stubs are not typed as such.
    async for reply in call:
        yield reply
