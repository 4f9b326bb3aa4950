"""The worker set: the sidecars this frontend sends generations to.

One :class:`Worker` per sidecar address: its own channel pool, a ``grpc.health.v1`` Watch on
``sidecar.v1.Worker`` (a worker is eligible only while that says SERVING), its ``ModelInfo``
(fetched once each time it comes to serve) and its ``GetLoad`` polled on a bounded interval.
Choice is the power of two choices over a load score (see :meth:`Worker.score`), among the
serving workers of one role and one model.

The set follows the fleet: it serves whatever models its workers serve (``models()``), so a
rollout from one model to another needs nothing from the frontend. A worker is refused (never
used, one error log line) when its sidecar's ``disaggregation_mode`` contradicts the role it
was given, or when the frontend was told which models to serve (``WorkerSetConfig.models``)
and it serves another. A refused worker is checked again when its sidecar restarts (its health
Watch breaks), so fixing the sidecar's flags is enough.

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
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio
import grpc
import structlog
from anyio.abc import TaskGroup
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.disaggregation import ROLES, Role, is_role
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import SidecarError
from sidecar_common.pool import ChannelPool, Deadline, PoolConfig, ReportSchedule
from sidecar_common.rpc import StubCache, bounded_call
from sidecar_common.tls import (
    ClientCredentials,
    TlsHandshakeError,
    tls_connector,
)
from sidecar_frontend.config import WorkerSetConfig

__all__ = [
    "HEALTH_SERVICE",
    "Refusal",
    "Role",
    "Worker",
    "WorkerObserver",
    "WorkerSet",
    "WorkerSetConfig",
    "WorkerState",
    "role_mismatch",
]

HEALTH_SERVICE: Final = "sidecar.v1.Worker"


log = structlog.get_logger("sidecar_frontend.workers")


class WorkerState(enum.Enum):
    CONNECTING = "connecting"
    NOT_SERVING = "not_serving"
    SERVING = "serving"
    REFUSED = "refused"  # see Worker.refusal
    DRAINING = "draining"


class Refusal(enum.Enum):
    """Why a worker is not used although it answers."""

    MODEL = "model"  # it serves a model this frontend was told not to serve
    ROLE = "role"  # its sidecar's disaggregation mode contradicts the role it was given


_HOW_TO_LIST: Final[Mapping[str, str]] = {
    "agg": "--worker {address}",
    "prefill": "--prefill-worker {address} (or --worker prefill={address})",
    "decode": "--worker decode={address}",
}


def role_mismatch(address: str, role: str, mode: str) -> str | None:
    """Why a worker given ``role`` cannot serve it when its sidecar reports ``mode`` (the
    ``ModelInfo.disaggregation_mode``), or None when they agree. An empty mode is a sidecar
    that does not say: aggregated, as the field's default means."""
    actual = mode or "agg"
    # A worker given a role needs its sidecar started with --disaggregation-mode <that role>.
    if role == actual:
        return None
    given = "an aggregated worker" if role == "agg" else f"a {role} worker"
    runs = "runs aggregated" if actual == "agg" else f"runs --disaggregation-mode {actual}"
    fix = _HOW_TO_LIST.get(actual)
    hint = (
        f"list it as {fix.format(address=address)}, or start its sidecar with --disaggregation-mode {role}"
        if fix is not None
        else f"start its sidecar with --disaggregation-mode {role}"
    )
    return f"worker {address} was given as {given} but its sidecar {runs}: {hint}"


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


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    pool: ChannelPool
    stubs: StubCache[sidecar_pb2_grpc.WorkerAsyncStub]
    state: WorkerState = WorkerState.CONNECTING
    model: sidecar_pb2.ModelInfo | None = None
    refusal: Refusal | None = None
    refusal_message: str = ""
    # The frontend's own generations on this worker (exact, updated per call).
    inflight: int = 0
    # The worker's last GetLoad (every frontend's generations) and our own count at that time.
    reported_inflight: int = 0
    own_at_report: int = 0
    # The prompt tokens this frontend's generations here still have to prefill (each counted
    # from its call to its first output): what a new request would queue behind.
    queued_prefill_tokens: int = 0
    # Its sidecar subscribes to its engine's KV events and serves them on WatchKvCache (the
    # last GetLoad's kv_cache.subscribed).
    publishes_cache: bool = False
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

    @property
    def served_model(self) -> str:
        """The model it serves ("" until its ModelInfo is known)."""
        return self.model.served_model_name if self.model is not None else ""

    def score(self) -> int:
        """Our exact in-flight count plus what other frontends had there at the last poll
        (the report includes ours as they were then, so those are taken off)."""
        others = max(0, self.reported_inflight - self.own_at_report)
        return self.inflight + others

    def stub(self) -> sidecar_pb2_grpc.WorkerAsyncStub:
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


class WorkerObserver(Protocol):
    """What the set tells about its workers (the frontend's metrics)."""

    def worker_refused(self, worker: Worker) -> None:
        """``worker`` was just refused (``worker.refusal`` says why)."""

    def worker_forgotten(self, worker: Worker) -> None:
        """``worker`` left the set: whatever is kept about it can go."""


class _Check(enum.Enum):
    SERVES = "serves"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # GetModelInfo failed: not SERVING yet, asked again


class WorkerSet:
    """``async with WorkerSet(config) as workers:`` owns every worker's tasks."""

    def __init__(
        self,
        config: WorkerSetConfig | None = None,
        *,
        rand: random.Random | None = None,
        observer: WorkerObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        companions: Sequence[Callable[[Worker], Coroutine[Any, Any, None]]] = (),
    ) -> None:
        self._config = config if config is not None else WorkerSetConfig()
        self._rand = rand if rand is not None else random.Random()
        self._observer = observer
        self._clock = clock
        # Tasks run beside each worker's own (the KV cache stream), from its first connection
        # until it leaves the set, in its scope.
        self._companions = tuple(companions)
        self._workers: dict[str, Worker] = {}
        self._group: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._changed = anyio.Event()
        # Eligible workers by role, and by (role, model), rebuilt on every state change (rare)
        # so that a choice costs O(1) whatever the size of the fleet.
        self._eligible: dict[str, list[Worker]] = {}
        self._eligible_by_model: dict[tuple[str, str], list[Worker]] = {}
        # Models that can take a generation now, each with the ModelInfo the formats read.
        self._models: dict[str, sidecar_pb2.ModelInfo] = {}
        # When each model was first seen serving (a tie-break: the newer model wins).
        self._first_seen: dict[str, int] = {}
        self._seen = 0
        self._idle_prefill: frozenset[str] = frozenset()
        self._announced: set[str] = set()
        self._credentials = ClientCredentials(self._config.tls) if self._config.tls is not None else None

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
        if not is_role(role):
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if address in self._workers:
            return
        if self._group is None:
            raise RuntimeError("WorkerSet is not running (use `async with`)")
        pool = self._new_pool(address)
        worker = Worker(address, role, pool, StubCache(pool, _worker_stub))
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

    # ---------------------------------------------------------------- what is served

    @property
    def model(self) -> sidecar_pb2.ModelInfo | None:
        """The model a request that names none runs on (None while no model can be served)."""
        name = self.default_model()
        return None if name is None else self._models[name]

    def models(self) -> Mapping[str, sidecar_pb2.ModelInfo]:
        """Every model a generation can be placed on now, by name (sorted)."""
        return self._models

    def default_model(self) -> str | None:
        """For a request that names no model: the one the most serving workers place
        generations for (aggregated or decode), the newer one on a tie. During a rollout
        from A to B the traffic follows the fleet as B's workers outnumber A's."""
        if not self._models:
            return None
        if len(self._models) == 1:
            return next(iter(self._models))

        def weight(name: str) -> tuple[int, int]:
            placing = len(self._eligible_by_model.get(("agg", name), ())) + len(
                self._eligible_by_model.get(("decode", name), ())
            )
            return placing, self._first_seen.get(name, 0)

        return max(self._models, key=weight)

    def misconfiguration(self) -> str | None:
        """Why the fleet cannot serve, when workers were refused for their role (the
        first such worker's reason), else None."""
        refused = sorted(
            (w for w in self._workers.values() if w.refusal is Refusal.ROLE), key=lambda w: w.address
        )
        return refused[0].refusal_message if refused else None

    # ---------------------------------------------------------------- choice

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def serving(self, role: str = "agg", model: str | None = None) -> list[Worker]:
        return [
            w
            for w in self._workers.values()
            if w.eligible and w.role == role and (model is None or w.served_model == model)
        ]

    def has_serving(self, role: str, model: str) -> bool:
        """Whether a worker of ``role`` serves ``model`` now: O(1), from the kept pools."""
        return any(w.eligible for w in self._eligible_by_model.get((role, model), ()))

    def routable(self, model: str | None = None) -> bool:
        """A generation (of ``model``, or of any model) can be placed: an aggregated worker,
        or a prefill and a decode one."""
        if model is None:
            return bool(self._models)
        return model in self._models

    def get(self, address: str) -> Worker | None:
        return self._workers.get(address)

    def pick(
        self, role: str = "agg", exclude: frozenset[str] = frozenset(), model: str | None = None
    ) -> Worker | None:
        """The less loaded of two serving workers drawn at random (power of two choices);
        never one that is not SERVING, never one in ``exclude``, only one serving ``model``
        when it is given. O(1) without exclusions (the first attempt of every request); a
        retry's exclusions may cost a scan of the role."""
        if model is None:
            pool = self._eligible.get(role, [])
        else:
            pool = self._eligible_by_model.get((role, model), [])
        if not exclude and len(pool) >= 2:
            size = len(pool)
            first_at = self._rand.randrange(size)
            second_at = self._rand.randrange(size - 1)
            if second_at >= first_at:
                second_at += 1
            first, second = pool[first_at], pool[second_at]
            if first.eligible and second.eligible:
                return second if second.score() < first.score() else first
        candidates = self.serving(role, model)
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

    async def wait_serving(self, count: int = 1, role: str = "agg", model: str | None = None) -> None:
        """Until at least ``count`` workers of ``role`` are SERVING (callers bound it)."""
        while len(self.serving(role, model)) < count:
            await self._changed.wait()

    # ---------------------------------------------------------------- per-worker tasks

    def _notify(self) -> None:
        eligible: dict[str, list[Worker]] = {}
        by_model: dict[tuple[str, str], list[Worker]] = {}
        for worker in self._workers.values():
            if worker.eligible:
                eligible.setdefault(worker.role, []).append(worker)
                by_model.setdefault((worker.role, worker.served_model), []).append(worker)
        self._eligible = eligible
        self._eligible_by_model = by_model
        self._models = self._placeable(by_model)
        for name in self._models:
            if name not in self._first_seen:
                self._seen += 1
                self._first_seen[name] = self._seen
        self._report_idle_prefill(by_model)
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    @staticmethod
    def _placeable(by_model: dict[tuple[str, str], list[Worker]]) -> dict[str, sidecar_pb2.ModelInfo]:
        """Each model with an aggregated worker or a prefill and a decode one, with the
        ModelInfo of a worker whose outputs the client sees (aggregated first, else decode)."""
        models: dict[str, sidecar_pb2.ModelInfo] = {}
        names = sorted({name for _, name in by_model})
        for name in names:
            agg = by_model.get(("agg", name))
            decode = by_model.get(("decode", name))
            shown = agg[0] if agg else decode[0] if decode and by_model.get(("prefill", name)) else None
            if shown is not None and shown.model is not None:
                models[name] = shown.model
        return models

    def _report_idle_prefill(self, by_model: dict[tuple[str, str], list[Worker]]) -> None:
        """One warning when prefill workers of a model serve but no decode worker does: they
        would never be used (requests run on the aggregated workers, if any)."""
        idle = frozenset(
            name for role, name in by_model if role == "prefill" and ("decode", name) not in by_model
        )
        for name in sorted(idle - self._idle_prefill):
            log.warning(
                "prefill workers unused: no decode worker serves their model",
                model=name,
                prefill_workers=sorted(w.address for w in by_model[("prefill", name)]),
                aggregated_workers=len(by_model.get(("agg", name), ())),
            )
        self._idle_prefill = idle

    def _set_state(self, worker: Worker, state: WorkerState) -> None:
        if worker.state is WorkerState.DRAINING or worker.state is state:
            return
        log.info(
            "worker state",
            worker=worker.address,
            state=state.value,
            was=worker.state.value,
            model=worker.served_model or None,
        )
        worker.state = state
        if state is not WorkerState.REFUSED:
            worker.refusal = None
            worker.refusal_message = ""
        self._notify()

    async def _run(self, worker: Worker) -> None:
        with worker.scope:
            await self._connect(worker)
            async with anyio.create_task_group() as group:
                group.start_soon(self._poll_load, worker)
                for companion in self._companions:
                    group.start_soon(companion, worker)
                await self._watch_health(worker)

    def _new_pool(self, address: str) -> ChannelPool:
        credentials = self._credentials
        return ChannelPool(
            PoolConfig(
                parse_endpoint(address),
                connections=self._config.connections,
                retry=self._config.retry,
                peer="worker",
            ),
            connector=tls_connector(credentials) if credentials is not None else None,
        )

    def _dialing(self, worker: Worker) -> str:
        return worker.pool.config.endpoint.target

    async def _connect(self, worker: Worker) -> None:
        """Until the worker's channels are up. While it does not answer, the pool says where
        it dials and why it fails (`waiting for worker`, at once, then at a doubling interval);
        each round that runs out is one more line here."""
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
                    dialling=self._dialing(worker),
                    error=err.message,
                    waited_secs=round(self._clock() - began, 1),
                )
                continue
            if failed:
                log.info(
                    "worker answering", worker=worker.address, waited_secs=round(self._clock() - began, 1)
                )
            return

    async def _watch_health(self, worker: Worker) -> None:
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        report = _Unanswered(self._config.report_first_secs, self._config.report_max_secs)
        while True:
            with anyio.CancelScope() as rewatch:
                worker.rewatch = rewatch
                why = await self._watch_once(worker, request, report)
            worker.rewatch = None
            if rewatch.cancelled_caught:
                continue  # new connections (TLS files rotated): watch there, state kept
            log.debug("health watch ended", worker=worker.address, why=why)
            # Checked again once it serves: a restarted worker may serve another model, or
            # have had its disaggregation mode fixed.
            worker.model = None
            if worker.state is WorkerState.REFUSED:
                worker.state = WorkerState.NOT_SERVING
                worker.refusal = None
                worker.refusal_message = ""
                self._notify()
            self._set_state(worker, WorkerState.NOT_SERVING)
            await anyio.sleep(self._config.rewatch_interval)

    async def _watch_once(
        self, worker: Worker, request: health_pb2.HealthCheckRequest, report: _Unanswered
    ) -> str:
        """One health Watch on the worker's connections, until it breaks; why it ended."""
        why = "its health Watch ended"
        try:
            stub = health_pb2_grpc.HealthStub(worker.pool.channel())
            call = stub.Watch(request)
            try:
                async for reply in _responses(call):
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        if worker.state is not WorkerState.REFUSED:
                            self._set_state(worker, WorkerState.NOT_SERVING)
                        continue
                    verdict = await self._check_model(worker, report)
                    if verdict is _Check.UNKNOWN:
                        return "GetModelInfo failed"  # a fresh Watch restates SERVING: checked again
                    if report.clear():
                        log.info("worker answering", worker=worker.address)
                    if verdict is _Check.SERVES:
                        self._set_state(worker, WorkerState.SERVING)
            finally:
                call.cancel()
        except (grpc.RpcError, SidecarError) as err:
            why = _describe(err)
            next_report = report.due(self._clock())
            if next_report is not None:
                log.warning(
                    "worker not answering",
                    worker=worker.address,
                    dialling=self._dialing(worker),
                    error=why,
                    waited_secs=round(report.lasted(self._clock()), 1),
                    next_report_secs=next_report,
                )
        return why

    async def _check_model(self, worker: Worker, report: _Unanswered) -> _Check:
        """Fetch the worker's ModelInfo once; refuse it when its role or model cannot be
        used."""
        model = worker.model
        if model is None:
            try:
                fetched: sidecar_pb2.ModelInfo = await bounded_call(
                    "GetModelInfo",
                    self._config.rpc_timeout,
                    lambda t: worker.stub().GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=t),
                )
            except SidecarError as err:
                next_report = report.due(self._clock())
                if next_report is not None:
                    log.warning(
                        "worker model info failed",
                        worker=worker.address,
                        dialling=self._dialing(worker),
                        error=err.message,
                        waited_secs=round(report.lasted(self._clock()), 1),
                        next_report_secs=next_report,
                    )
                return _Check.UNKNOWN
            model = worker.model = fetched
            if model.served_model_name not in self._announced:
                self._announced.add(model.served_model_name)
                log.info(
                    "model",
                    model=model.served_model_name,
                    engine=model.engine,
                    worker=worker.address,
                )
        if worker.state is WorkerState.REFUSED:
            return _Check.REFUSED
        mismatch = role_mismatch(worker.address, worker.role, model.disaggregation_mode)
        if mismatch is not None:
            self._refuse(worker, Refusal.ROLE, mismatch)
            return _Check.REFUSED
        allowed = self._config.models
        if allowed and model.served_model_name not in allowed:
            self._refuse(
                worker,
                Refusal.MODEL,
                f"worker {worker.address} serves {model.served_model_name!r}, not one of the models "
                f"this frontend serves ({', '.join(sorted(allowed))})",
            )
            return _Check.REFUSED
        return _Check.SERVES

    def _refuse(self, worker: Worker, refusal: Refusal, message: str) -> None:
        if worker.state is WorkerState.DRAINING:
            return
        worker.state = WorkerState.REFUSED
        worker.refusal = refusal
        worker.refusal_message = message
        log.error("worker refused", worker=worker.address, reason=refusal.value, error=message)
        if self._observer is not None:
            self._observer.worker_refused(worker)
        self._notify()

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
                worker.publishes_cache = report.kv_cache.subscribed
            except SidecarError as err:
                log.debug("worker load poll failed", worker=worker.address, error=err.message)
            await anyio.sleep(self._config.load_poll_interval)

    async def _forget_when_idle(self, worker: Worker) -> None:
        while worker.inflight:
            await worker.idle.wait()
        worker.scope.cancel()
        await worker.pool.close()
        if self._workers.get(worker.address) is worker:
            del self._workers[worker.address]
        log.info("worker drained", worker=worker.address)
        if self._observer is not None:
            self._observer.worker_forgotten(worker)
        self._notify()

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
            await pool.connect(Deadline.start(pool.clock, self._config.redial_secs))
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
        worker.stubs = StubCache(pool, _worker_stub)
        worker.tls_version = version
        if worker.rewatch is not None:
            worker.rewatch.cancel()
        log.info("worker reconnected with the new TLS files", worker=worker.address)
        if self._group is not None:
            self._group.start_soon(old.close, self._config.retire_grace)


def _worker_stub(channel: grpc.aio.Channel) -> sidecar_pb2_grpc.WorkerAsyncStub:
    # The generated stub's constructor answers an asyncio channel with its typed async stub.
    return sidecar_pb2_grpc.WorkerStub(channel)


def _describe(error: BaseException) -> str:
    if isinstance(error, SidecarError):
        return error.message
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        status = code()
        name = status.name if isinstance(status, grpc.StatusCode) else str(status)
        return f"{details() or 'no details'} ({name})"
    return repr(error)


async def _responses(call: Any) -> AsyncIterator[Any]:
    # grpc.aio's stream calls are async iterables, but the stubs are not typed as such.
    async for reply in call:
        yield reply
