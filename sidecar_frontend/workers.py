"""The worker set: the sidecars this frontend sends generations to, in three parts.

- :mod:`sidecar_frontend.registry` (pure): each worker's state, model, load and eligibility,
  the models the fleet serves, and the choice among workers.
- :mod:`sidecar_frontend.agent`: one agent per worker (dial, health Watch, model check, load
  poll, redial after a TLS rotation), its tasks supervised.
- :mod:`sidecar_frontend.worker_events`: ``joined`` / ``changed`` / ``left``, to which routing
  (each worker's KV stream, a departed model's index), metrics and waiters subscribe.

:class:`WorkerSet` puts them together and is the sink of worker discovery: ``add_worker`` /
``drain_worker`` / ``addresses`` are all a discovery source (static ``--worker`` flags, etcd,
DNS) needs. Every task runs under a :class:`~sidecar_frontend.supervisor.Supervisor`: the
server's (``WorkerSet(..., supervisor=...)``), or one of its own entered with
``async with WorkerSet(...)``.

A worker is refused (never used, one error log line) when its sidecar's
``disaggregation_mode`` contradicts the role it was given, or when the frontend was told which
models to serve (``WorkerSetConfig.models``) and it serves another. A refused worker is checked
again when its sidecar restarts (its health Watch breaks), so fixing the sidecar's flags is
enough. A worker that sends what cannot be believed (a reply that does not decode, absurd
values) is taken out of routing for a backoff (``misbehaviour``: every part that reads a worker's
replies reports to it; the set ejects). A worker whose Generate calls fail of its own fault
several times in a row is taken out too (``outliers.py`` decides; the attempt runner reports
each call's end to :meth:`WorkerSet.call_succeeded` / :meth:`WorkerSet.call_failed`), then
readmitted on probation (one call at a time) until a call succeeds; the last eligible worker of
its role and model is never taken out this way.

With ``WorkerSetConfig.tls`` every worker is dialled over TLS (mutual TLS with a client
certificate); the files are re-read when they change, and each worker's connections are
replaced by connections made with the new files (docs/frontend.md, "TLS to the workers").
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Final

import anyio
import structlog
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import ROLES, Role, is_role
from sidecar_common.errors import FailureReason
from sidecar_common.retry import Backoff
from sidecar_common.rpc import StubCache
from sidecar_common.tls import ClientCredentials
from sidecar_frontend.agent import HEALTH_SERVICE, WorkerAgent, new_pool, worker_stub
from sidecar_frontend.config import WorkerSetConfig
from sidecar_frontend.misbehaviour import Misbehaviour, MisbehaviourReporter
from sidecar_frontend.outliers import Outliers, OutlierSettings, Verdict, counts_against
from sidecar_frontend.registry import Refusal, Registry, Worker, WorkerState, role_mismatch
from sidecar_frontend.supervisor import Supervisor
from sidecar_frontend.worker_events import WorkerEvents, WorkerListener

__all__ = [
    "HEALTH_SERVICE",
    "Refusal",
    "Role",
    "Worker",
    "WorkerListener",
    "WorkerSet",
    "WorkerSetConfig",
    "WorkerState",
    "role_mismatch",
]

log = structlog.get_logger("sidecar_frontend.workers")

# A misbehaving worker is out of routing for a pause that doubles with each misbehaviour in a
# row (jittered), from the first to the cap; one that behaves for EJECTION_FORGIVEN_SECS starts over.
EJECTION_FIRST_SECS: Final = 5.0
EJECTION_MAX_SECS: Final = 300.0
EJECTION_FORGIVEN_SECS: Final = 600.0
# How long a departing worker's tasks get to end (they end at their next await) before its
# channels are closed anyway.
TASKS_END_SECS: Final = 5.0


class WorkerSet:
    """The registry, the agents and the events of one frontend's workers."""

    def __init__(
        self,
        config: WorkerSetConfig | None = None,
        *,
        rand: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
        misbehaviour: MisbehaviourReporter | None = None,
        outliers: OutlierSettings | None = None,
    ) -> None:
        self._config = config if config is not None else WorkerSetConfig()
        self._clock = clock
        self.events: WorkerEvents[Worker] = WorkerEvents()
        self.registry = Registry(
            self.events, allowed_models=self._config.models, rand=rand, fleet=self._config.fleet
        )
        self._supervisor = supervisor
        self._own_supervisor = supervisor is None
        self._agents: dict[str, WorkerAgent] = {}
        self._idle_prefill: frozenset[str] = frozenset()
        self._announced: set[str] = set()
        # Misbehaviours in a row per worker, and when the last one was.
        self._strikes: dict[str, tuple[int, float]] = {}
        # Workers whose connections are being replaced now (one redial at a time each).
        self._redialing: set[str] = set()
        self._credentials = ClientCredentials(self._config.tls) if self._config.tls is not None else None
        self.events.subscribe(_IdlePrefillWarning(self))
        # Every part that reads a worker's replies reports its misbehaviour here (logged,
        # counted); the set takes the worker out of routing.
        self.misbehaviour = (
            misbehaviour if misbehaviour is not None else MisbehaviourReporter(CollectorRegistry())
        )
        self.misbehaviour.subscribe(self._on_misbehaviour)
        # Own-fault failures in a row per worker, and who is ejected or on probation for them.
        self.outliers = Outliers(outliers)
        if supervisor is not None:
            self._start_own_tasks()

    async def __aenter__(self) -> WorkerSet:
        if self._own_supervisor:
            self._supervisor = Supervisor()
            await self._supervisor.__aenter__()
            self._start_own_tasks()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            if self._own_supervisor and self._supervisor is not None:
                supervisor, self._supervisor = self._supervisor, None
                return await supervisor.__aexit__(exc_type, exc, tb)
            return None
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop every worker's tasks, then close its connections."""
        workers = self.registry.workers()
        supervisor = self._supervisor
        with anyio.CancelScope(shield=True):
            if supervisor is not None and supervisor.running:
                for worker in workers:
                    supervisor.stop_owner(worker.address)
                with anyio.move_on_after(TASKS_END_SECS):
                    for worker in workers:
                        await supervisor.until_ended(worker.address)
            for worker in workers:
                await worker.pool.close()
        self._agents.clear()

    @property
    def supervisor(self) -> Supervisor:
        if self._supervisor is None or not self._supervisor.running:
            raise RuntimeError("WorkerSet is not running (use `async with`, or give it a running supervisor)")
        return self._supervisor

    def _start_own_tasks(self) -> None:
        if self._credentials is not None:
            credentials = self._credentials
            self.supervisor.start("tls_files", lambda: self._follow_tls_files(credentials))

    # ---------------------------------------------------------------- the discovery sink

    def add_worker(self, address: str, role: str = "agg") -> None:
        """Start using the sidecar at ``address`` (host:port). Idempotent; a worker being
        drained stays drained (it is forgotten once idle, and may be added again then)."""
        if not is_role(role):
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if self.registry.get(address) is not None:
            return
        supervisor = self.supervisor
        pool = new_pool(address, self._config, self._credentials)
        worker = Worker(address, role, pool, StubCache(pool, worker_stub))
        worker.idle.set()
        agent = WorkerAgent(
            worker,
            self.registry,
            supervisor,
            self._config,
            credentials=self._credentials,
            set_state=self.set_state,
            refuse=self.refuse,
            misbehaviour=self.misbehaviour,
            announce_model=self._announce_model,
            clock=self._clock,
        )
        self._agents[address] = agent
        log.info("worker added", worker=address, role=role)
        self.registry.add(worker)
        agent.start()

    def drain_worker(self, address: str) -> None:
        """No new generations on ``address``; those in flight finish; then its channels are
        closed and it is forgotten."""
        worker = self.registry.get(address)
        if worker is None or self._supervisor is None or not self._supervisor.running:
            return
        if not self.registry.drain(worker):
            return
        log.info("worker draining", worker=address, inflight=worker.inflight)
        self._supervisor.start("drain", lambda: self._forget_when_idle(worker), worker=address, restart=False)

    def addresses(self) -> frozenset[str]:
        return self.registry.addresses()

    async def _forget_when_idle(self, worker: Worker) -> None:
        while worker.inflight:
            await worker.idle.wait()
        supervisor = self.supervisor
        supervisor.stop_owner(worker.address)
        # Its tasks end before its channels close: a channel closing under a call cancels the
        # call, and a task that is being stopped would see that cancel rather than its own.
        with anyio.move_on_after(TASKS_END_SECS):
            await supervisor.until_ended(worker.address)
        if self._agents.get(worker.address) is not None and self.registry.holds(worker):
            del self._agents[worker.address]
        self._strikes.pop(worker.address, None)
        self.outliers.forget(worker.address)
        await worker.pool.close()
        log.info("worker drained", worker=worker.address)
        self.registry.remove(worker)

    # ---------------------------------------------------------------- changes, logged

    def set_state(self, worker: Worker, state: WorkerState) -> None:
        was = worker.state
        if self.registry.set_state(worker, state):
            log.info(
                "worker state",
                worker=worker.address,
                state=state.value,
                was=was.value,
                model=worker.served_model or None,
            )

    def refuse(self, worker: Worker, refusal: Refusal, message: str) -> None:
        if self.registry.refuse(worker, refusal, message):
            log.error("worker refused", worker=worker.address, reason=refusal.value, error=message)

    def _on_misbehaviour(self, address: str, kind: Misbehaviour, detail: str) -> None:
        """A worker sent what cannot be believed (the reporter logged and counted it): out of
        routing for a backoff that grows while it keeps misbehaving, then back. One line per
        ejection (rate-limited by the backoff itself)."""
        worker = self.registry.get(address)
        if worker is None or worker.state is WorkerState.DRAINING:
            return
        now = self._clock()
        strikes, last = self._strikes.get(address, (0, now))
        if worker.ejected_until is not None:
            return  # out already: this is the same spell of misbehaviour
        strikes = 1 if now - last >= EJECTION_FORGIVEN_SECS else strikes + 1
        self._strikes[address] = (strikes, now)
        pause = Backoff(EJECTION_FIRST_SECS, EJECTION_MAX_SECS).pause(strikes)
        self.registry.eject(worker, now + pause, f"{kind.value}: {detail}")
        log.error(
            "worker out of routing: it misbehaved",
            worker=address,
            kind=kind.value,
            ejected_for_secs=round(pause, 1),
            strikes=strikes,
        )
        self._readmit_later(worker, pause)

    # ---------------------------------------------------------------- outlier ejection

    def call_succeeded(self, worker: Worker) -> bool:
        """A Generate call on ``worker`` ended with every terminal delivered. Whether that
        restored it (it was on probation: now it takes calls as any other; logged)."""
        if not self.registry.holds(worker):
            return False
        if self.outliers.succeeded(worker.address) is not Verdict.RESTORED:
            return False
        worker.probation = False
        log.info("worker restored", worker=worker.address)
        return True

    def call_failed(self, worker: Worker, reason: FailureReason) -> bool:
        """A Generate call on ``worker`` failed for ``reason``. Whether that ejected it: the
        failures of its own fault (``outliers.OWN_FAULT``) in a row reached the setting, or its
        probe failed; out of routing for a pause that doubles with each ejection in a row
        (logged). The last eligible worker of its role and model is not ejected (logged). A
        paused worker's failures never count (paused is not down), and an ENGINE_PAUSED one
        marks it paused at once."""
        if reason is FailureReason.ENGINE_PAUSED and self.registry.note_paused(worker):
            # News of the pause before its sidecar's next report: no new request goes there.
            log.info("worker paused: its engine refused a request for its pause", worker=worker.address)
        if not counts_against(reason, paused=worker.paused):
            return False
        if not self.registry.holds(worker) or worker.state is WorkerState.DRAINING:
            return False
        now = self._clock()
        ejection = self.outliers.failed(worker.address, now)
        if ejection is None:
            return False
        worker.probation = False
        if not any(
            other is not worker and other.eligible
            for other in self.registry.eligible_of(worker.role, worker.served_model)
        ):
            self.outliers.spared(worker.address)
            log.warning(
                "worker not ejected: the last eligible one of its model",
                worker=worker.address,
                role=worker.role,
                model=worker.served_model or None,
                failures=ejection.failures,
                reason="consecutive failures",
                last_failure=reason.value,
            )
            return False
        pause = ejection.until - now
        self.registry.eject(worker, ejection.until, f"consecutive failures (the last: {reason.value})")
        log.warning(
            "worker ejected",
            worker=worker.address,
            failures=ejection.failures,
            strikes=ejection.strikes,
            until=round(ejection.until, 3),
            ejected_for_secs=round(pause, 1),
            reason="consecutive failures",
            last_failure=reason.value,
        )
        self._readmit_later(worker, pause)
        return True

    def _readmit_later(self, worker: Worker, pause: float) -> None:
        if self._supervisor is not None and self._supervisor.running:
            self._supervisor.start(
                "readmit",
                functools.partial(self._readmit_after, worker, pause),
                owner=worker.address,
                restart=False,
            )

    async def _readmit_after(self, worker: Worker, pause: float) -> None:
        """Back in routing once its ejection ran out (a later ejection's task readmits it
        when that one ends later); on probation when its failures ejected it."""
        await anyio.sleep(pause)
        if self.registry.readmit(worker, self._clock()):
            worker.probation = self.outliers.readmitted(worker.address)
            log.info(
                "worker back in routing after its ejection", worker=worker.address, probation=worker.probation
            )

    def _announce_model(self, worker: Worker, model: sidecar_pb2.ModelInfo) -> None:
        if model.served_model_name not in self._announced:
            self._announced.add(model.served_model_name)
            log.info("model", model=model.served_model_name, engine=model.engine, worker=worker.address)

    def report_idle_prefill(self) -> None:
        """One warning when prefill workers of a model serve but no decode worker does: they
        would never be used (requests run on the aggregated workers, if any)."""
        idle = self.registry.idle_prefill_models()
        for name in sorted(idle - self._idle_prefill):
            log.warning(
                "prefill workers unused: no decode worker serves their model",
                model=name,
                prefill_workers=sorted(w.address for w in self.registry.eligible_of("prefill", name)),
                aggregated_workers=len(self.registry.eligible_of("agg", name)),
            )
        self._idle_prefill = idle

    # ---------------------------------------------------------------- what is served (the registry's)

    @property
    def model(self) -> sidecar_pb2.ModelInfo | None:
        """The model a request that names none runs on (None while no model can be served)."""
        name = self.registry.default_model()
        return None if name is None else self.registry.models()[name]

    def models(self) -> Mapping[str, sidecar_pb2.ModelInfo]:
        return self.registry.models()

    def default_model(self) -> str | None:
        return self.registry.default_model()

    def misconfiguration(self) -> str | None:
        return self.registry.misconfiguration()

    def workers(self) -> list[Worker]:
        return self.registry.workers()

    def serving(self, role: str = "agg", model: str | None = None) -> list[Worker]:
        return self.registry.serving(role, model)

    def has_serving(self, role: str, model: str) -> bool:
        return self.registry.has_serving(role, model)

    def routable(self, model: str | None = None) -> bool:
        return self.registry.routable(model)

    def get(self, address: str) -> Worker | None:
        return self.registry.get(address)

    def pick(
        self, role: str = "agg", exclude: frozenset[str] = frozenset(), model: str | None = None
    ) -> Worker | None:
        return self.registry.pick(role, exclude, model)

    def next_change(self) -> anyio.Event:
        """Set at the next change of any worker (taken before looking, so no change between
        the look and the wait is missed)."""
        return self.events.next_change()

    # ---------------------------------------------------------------- pauses and weight versions

    @property
    def paused_hold(self) -> float:
        """How long a request waits while its model's fleet is held (--paused-hold-secs)."""
        return self._config.fleet.paused_hold

    def held(self, model: str) -> bool:
        """Whether ``model``'s workers serve but none takes new requests (fleet.py)."""
        return self.registry.held(model)

    async def hold(self, model: str) -> str | None:
        """While ``model``'s fleet is held, wait (woken by the worker set's changes) until a
        worker takes its new requests; None then, or at once when it is not held. Past
        ``paused_hold`` seconds, why it is still held. Cancelling it (the client left) ends
        the wait at once."""
        registry = self.registry
        if not registry.held(model):
            return None
        registry.holding += 1
        try:
            with anyio.move_on_after(self.paused_hold):
                while True:
                    changed = self.events.next_change()
                    if not registry.held(model):
                        return None
                    await changed.wait()
        finally:
            registry.holding -= 1
        return f"{self.registry.held_reason(model)}, for {self.paused_hold:g}s (--paused-hold-secs)"

    def no_worker_message(self, model: str) -> str:
        """Why an attempt found no worker for ``model``: its fleet is held, or none serves it."""
        if self.registry.held(model):
            return f"{self.registry.held_reason(model)}, for {self.paused_hold:g}s (--paused-hold-secs)"
        return f"no worker is serving {model}"

    def set_weight_version(self, version: str | None) -> None:
        """The fleet's newest weight version, as an admin call set it (None: back to the newest
        reported); logged."""
        news = self.registry.set_weight_version(version)
        log.info(
            "fleet weight version set",
            weight_version=self.registry.versions.newest,
            set_by_admin=version is not None,
            changed=news.newest_changed,
        )

    async def wait_serving(self, count: int = 1, role: str = "agg", model: str | None = None) -> None:
        """Until at least ``count`` workers of ``role`` are eligible (callers bound it)."""
        while True:
            changed = self.events.next_change()
            if len(self.serving(role, model)) >= count:
                return
            await changed.wait()

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
                for w in self.registry.workers()
                if w.tls_version
                and w.tls_version != credentials.version
                and w.state is not WorkerState.DRAINING
            ]
            for worker in stale:
                agent = self._agents.get(worker.address)
                if agent is not None and worker.address not in self._redialing:
                    self._redialing.add(worker.address)
                    self.supervisor.start(
                        "redial",
                        functools.partial(self._redial, agent, credentials.version),
                        owner=worker.address,
                        restart=False,  # the next look at the files tries again
                    )

    async def _redial(self, agent: WorkerAgent, version: int) -> None:
        try:
            await agent.redial(version)
        finally:
            self._redialing.discard(agent.worker.address)


class _IdlePrefillWarning:
    """The worker set's own listener: the unused-prefill warning, at each change."""

    def __init__(self, workers: WorkerSet) -> None:
        self._workers = workers

    def joined(self, worker: Worker) -> None:
        pass

    def changed(self, worker: Worker) -> None:
        self._workers.report_idle_prefill()

    def left(self, worker: Worker) -> None:
        self._workers.report_idle_prefill()
