"""The attempt runner: where one sub-request runs, and again after its worker failed.

For each sub-request the HTTP side (``exchange.py``) hands over, :meth:`AttemptRunner.run`
chooses a worker (``placement.py``: a routing policy plugs in as its ``WorkerChoice``), makes the
``Generate`` call, and gives every output to the :class:`Recipient`. With prefill and decode
workers of the model serving, an attempt is disaggregated: prefill on one, decode on the other
with the prefill's handoff (``disagg.py``). When an attempt fails, :class:`attempts.Attempts`
decides what runs next: a retry on another worker while nothing was delivered, a migration
(continuation from the delivered tokens) after that. The runner ends with the sub-request's
failure, or None when every choice's terminal was delivered.

Overload (issue 27): a retry (a move before anything was delivered, an engine's busy refusal
included) first asks the frontend's :class:`~sidecar_frontend.retry_budget.RetryBudget`, which
allows a fraction of the sub-requests completed recently (each completed sub-request is told to
it) plus a small floor; refused, the sub-request ends with the failure it had (the client gets
the worker's own answer, a busy 503 for a busy worker), counted in
``frontend_retries_refused_total`` and logged. So an overloaded fleet never multiplies its own
load. A retry after a busy answer only goes to a worker that serves now and has not answered
this sub-request busy (``attempts.py``). Migrations (after tokens were delivered) are not
charged: ``--migration-limit`` bounds them per sub-request. Each Generate call's end is told to
the worker set (:meth:`~sidecar_frontend.workers.WorkerSet.call_succeeded` when it delivered
every terminal, :meth:`~sidecar_frontend.workers.WorkerSet.call_failed` when it failed), which
ejects a worker whose calls keep failing of its own fault (``outliers.py``) and counts nothing
itself: the ejections and restorations it reports are counted here.

A call its engine refused because it is paused (ENGINE_PAUSED, before any output) is no move
and spends no budget: the worker set takes that worker as paused, and the same request goes to
a worker that takes new requests, or waits while every worker of the model is paused
(``placement.py``, ``fleet.py``).

Cancellation: each attempt runs in the sub-request's own cancel scope (:class:`SubCall`), so
an abort by id ends it; leaving a call cancels it, and the sidecar aborts the engine request.

Preemption (admission, ``admission/gate.py``): :meth:`SubCall.preempt` cancels the current
attempt the same way, with a marker. That is no worker's failure: no retry budget, no outlier
count, no worker failure metric, no move against ``--migration-limit``. The sub-request waits
until its request is admitted again (:meth:`Recipient.readmit`, shared by the request's
sub-requests), then runs the same request again when nothing was delivered, else the
continuation from the delivered tokens (``Attempts.after_preemption``), on any worker (the one
it ran on included): the client sees a pause. One ``request preempted`` line (the worker, the
tokens delivered, its urgency and the waiting request's) and one ``request resumed`` line (how
long it waited) per pause. A sub-request that starts while its request is preempted waits
first.

A worker is not trusted (``misbehaviour.py``): every reply of a call is decoded or refused (a
``None`` from grpc.aio is a message that did not decode; a status whose details do not decode
is refused too), and every output is checked before the client is given it (its choice, its
token ids against the model's ``vocab_size``, a LENGTH finish with no token). A worker that
misbehaves is reported (the runner's ``misbehaviour`` reporter) and its call fails as a
protocol error: another worker takes the sub-request while nothing was delivered, else it ends
with the format's error. Once every choice's terminal was delivered the call is left: a worker
has ``end_grace`` seconds to end its stream, then it is cancelled, so the response ends
whatever the worker does next.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Final, Protocol

import anyio
import grpc
import structlog
from anyio.abc import TaskGroup

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FAILURE_RULES, FailureReason
from sidecar_common.rpc import cancel_is_ours
from sidecar_common.tracing import SpanKind, Tracing, outgoing_metadata
from sidecar_frontend import disagg, pd_experts
from sidecar_frontend.admission.state import Preemption
from sidecar_frontend.attempts import Attempts, Finish, Refusal, misbehaved, read_rpc_error
from sidecar_frontend.fleet import PAUSED_REFUSALS_LIMIT
from sidecar_frontend.formats.base import WorkerFailure
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.misbehaviour import NO_REPORTS, Fault, Misbehaviour, OutputCheck, Reporter
from sidecar_frontend.placement import CallWatch, WorkerChoice, least_loaded, place
from sidecar_frontend.resume import RESUME_HEADER, RESUME_LIMIT, by_span
from sidecar_frontend.retry_budget import RetryBudget
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = [
    "END_GRACE",
    "AttemptRunner",
    "OutputNotEncoded",
    "Recipient",
    "RunnerConfig",
    "SubCall",
    "Tally",
]

# A gRPC deadline a little past our own: only a backstop, our deadline speaks first.
_GRPC_DEADLINE_SLACK: Final = 5.0
# After every terminal was delivered, how long a worker has to end its stream before the call
# is cancelled. A sidecar ends it at once (its trailers follow the last output); waiting for
# them rather than cancelling at once keeps a complete call from reaching the sidecar as a
# client's cancel (cancelling at once, 25 of 60 complete calls over two testkit sidecars were
# logged by their sidecar as cancelled by the client). Only a worker that keeps its stream
# open makes a response wait this long.
END_GRACE: Final = 1.0

log = structlog.get_logger("sidecar_frontend.handler")


class RunnerConfig(Protocol):
    """What the runner reads of the frontend's configuration (``handler.HandlerConfig``)."""

    @property
    def request_timeout(self) -> float | None:
        """The frontend's deadline of a request (None: none); its calls get a little more."""

    @property
    def migration_limit(self) -> int:
        """Moves to another worker per sub-request (``Attempts``)."""

    @property
    def worker_wait(self) -> float:
        """How long a retry or a migration waits for a worker to serve when none does."""

    @property
    def start_slots(self) -> int:
        """Calls left waiting at one sidecar for its server to take them up (``_call``)."""


@dataclass(eq=False)
class SubCall:
    """One sub-request in flight: what abort by id reaches, and its attempts so far."""

    public_id: str
    index: int
    attempts: Attempts
    scope: anyio.CancelScope | None = None
    aborted: bool = False
    # Set by preempt while its current attempt is being stopped.
    preempted: Preemption | None = None
    # An output is being written to the client: a preemption waits for it (_Run._give).
    delivering: bool = False
    # The call in flight that asked its worker for one answer: (worker, the call's request id).
    unary_call: tuple[Worker, str] | None = None
    # The client asked that a generation its engine aborted on its own go on (resume.py).
    resume_on_abort: bool = False

    def abort(self) -> None:
        self.aborted = True
        if self.scope is not None:
            self.scope.cancel()

    def abort_for_answer(self, now: float, grace: float) -> tuple[Worker, str] | None:
        """Abort by id, keeping the answer of a call that asked for one answer: its sidecar is
        to abort it on the engine (the caller sends the Abort), and the engine's answer, with
        the tokens made so far, reaches the client as the real servers answer an aborted
        non-streaming request. The attempt is cancelled at ``now + grace`` (anyio's clock)
        if that answer has not come. Any other call is cancelled at once (None)."""
        if self.unary_call is None or self.scope is None:
            self.abort()
            return None
        self.aborted = True
        self.scope.deadline = min(self.scope.deadline, now + grace)
        return self.unary_call

    def preempt(self, cause: Preemption) -> None:
        """Stop the current attempt (its engine request is aborted); the sub-request waits to be
        admitted again, then goes on from what it delivered."""
        self.preempted = cause
        if self.scope is not None and not self.delivering:
            self.scope.cancel()


@dataclass
class Tally:
    """What the attempts of one HTTP request did, for its log line."""

    workers: list[str] = field(default_factory=list)
    retries: int = 0
    migrations: int = 0
    # Pauses of its sub-requests by preemption.
    preemptions: int = 0


class OutputNotEncoded(Exception):
    """What :meth:`Recipient.deliver` raises when the format could not turn an output into
    the client's terms (an output no check here foresaw: lists of disagreeing lengths, ...)."""


class Recipient(Protocol):
    """The HTTP side of one request, as the runner sees it."""

    @property
    def format_name(self) -> str:
        """The metrics' ``format`` label."""

    @property
    def model(self) -> str:
        """What every sub-request runs on."""

    @property
    def tally(self) -> Tally:
        """Where the attempts count what they did, for the request's log line."""

    async def deliver(self, index: int, output: sidecar_pb2.LLMEngineOutput) -> None:
        """Give sub-request ``index``'s ``output`` (already in the client's terms) to the client;
        raises :class:`OutputNotEncoded` when the format could not take it."""

    @property
    def preemption(self) -> Preemption | None:
        """Why the request's admission was taken back, until it is admitted again; None while
        it holds its admission (or has none to lose)."""

    async def readmit(self) -> bool:
        """Wait until the request is admitted again after a preemption (at once when it was
        not preempted); False when it never will be (the frontend stops)."""


class AttemptRunner:
    """Runs sub-requests on the worker set; one per frontend, shared by every request."""

    def __init__(
        self,
        workers: WorkerSet,
        config: RunnerConfig,
        *,
        choice: WorkerChoice | None = None,
        watch: CallWatch | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: random.Random | None = None,
        tracing: Tracing | None = None,
        misbehaviour: Reporter = NO_REPORTS,
        end_grace: float = END_GRACE,
        retry_budget: RetryBudget | None = None,
    ) -> None:
        self.workers = workers
        self.config = config
        self.choice = choice if choice is not None else least_loaded(workers)
        # What the routing policy follows of each call (None: nothing).
        self.watch = watch
        self.metrics = metrics
        self.clock = clock
        self.rand = rand if rand is not None else random.Random()
        self.tracing = tracing if tracing is not None else Tracing()
        # Each SGLang prefill worker's bootstrap server, learned from its first handoff.
        self.bootstraps: dict[str, disagg.BootstrapAddress] = {}
        # Told whenever a worker misbehaves (the handler gives the worker set's reporter, which
        # logs, counts and takes the worker out of routing; by default nobody is told).
        self.misbehaviour = misbehaviour
        self.end_grace = end_grace
        # Every retry across workers of every sub-request asks it first (module docstring).
        self.retry_budget = retry_budget if retry_budget is not None else RetryBudget()

    def attempts(self, request: sidecar_pb2.PreprocessedRequest) -> Attempts:
        return Attempts(request, self.config.migration_limit)

    async def run(self, sub: SubCall, to: Recipient) -> WorkerFailure | None:
        """Run ``sub`` until every terminal was delivered (None) or it failed for good."""
        run = _Run(self, sub, to)
        return await run.until_done()

    # ------------------------------------------------------------------ metrics

    def lease_changed(self, worker: Worker) -> None:
        if self.metrics is not None:
            self.metrics.set_worker_inflight(worker.address, worker.inflight)

    def worker_failed(self, worker: Worker, failure: WorkerFailure) -> None:
        """A Generate call on ``worker`` failed: counted, and told to the worker set (which
        may eject it)."""
        if self.metrics is not None:
            self.metrics.worker_failed(worker.address, failure.reason.value)
        if self.workers.call_failed(worker, failure.reason) and self.metrics is not None:
            self.metrics.worker_ejected()

    def worker_succeeded(self, worker: Worker) -> None:
        """A Generate call on ``worker`` ended with its part done (every terminal delivered,
        or a prefill's handoff given): told to the worker set (which may restore it)."""
        if self.workers.call_succeeded(worker) and self.metrics is not None:
            self.metrics.worker_restored()

    def misbehaved(self, worker: Worker, fault: Fault) -> WorkerFailure:
        """Report ``worker``'s fault; the failure its call ends with."""
        self.misbehaviour.report(worker.address, fault.kind, fault.detail)
        return misbehaved(worker.address, fault)


@dataclass(eq=False)
class _Run:
    """One sub-request across its attempts."""

    runner: AttemptRunner
    sub: SubCall
    to: Recipient
    tried: list[str] = field(default_factory=list)
    # The move (retry or migration) decided after a failure, counted once a worker takes it.
    moving: tuple[str, WorkerFailure] | None = None
    # The workers of the current attempt, once placed.
    placed: tuple[str, ...] = ()
    # When the sub-request was last paused by a preemption (None: it is not paused).
    paused_at: float | None = None
    # Calls refused because their engine was paused (ENGINE_PAUSED), none counted as a move.
    paused_refusals: int = 0
    # Times its engine aborted it on its own and it went on (resume.py), and whether the
    # attempt that just ended was one.
    resumes: int = 0
    resuming: bool = False
    # The checks of every output the client is given, across attempts.
    check: OutputCheck = field(init=False)

    def __post_init__(self) -> None:
        self.check = OutputCheck(self.sub.attempts.request)

    async def until_done(self) -> WorkerFailure | None:
        sub, attempts = self.sub, self.sub.attempts
        current = attempts.request
        failure: WorkerFailure | None = None
        previous: WorkerFailure | None = None
        while True:
            if sub.aborted:
                return WorkerFailure.of(FailureReason.CANCELLED, "aborted by request id")
            if self.to.preemption is not None or self.paused_at is not None:
                stopped = await self._until_readmitted()
                if stopped is not None:
                    return stopped
                continue  # aborted, or preempted again, meanwhile: look again
            sub.preempted = None
            self.placed = ()
            with anyio.CancelScope() as scope:
                sub.scope = scope
                failure = await self._attempt(current)
            sub.scope = None
            if scope.cancelled_caught:
                if sub.aborted or sub.preempted is None:
                    return WorkerFailure.of(FailureReason.CANCELLED, "aborted by request id")
                after = await self._after_preemption(sub.preempted)
                if not isinstance(after, sidecar_pb2.PreprocessedRequest):
                    return after
                current = after
                continue
            if self.resuming:
                self.resuming = False
                resumed = await self._resume(failure)
                if not isinstance(resumed, sidecar_pb2.PreprocessedRequest):
                    return resumed
                current = resumed
                continue
            if failure is None:
                self.runner.retry_budget.succeeded(self.runner.clock())
                return None
            if failure.reason is FailureReason.NO_WORKER:
                if self.moving is not None and self.moving[0] == "migrated":
                    self._migration_outcome("no_worker", self.moving[1])
                # Say why the last worker failed rather than that no other one was left.
                return previous or failure
            previous = failure
            if failure.reason is FailureReason.NOT_STARTED:
                if not await self._after_unstarted(failure):
                    return failure
                continue  # the same request (or continuation) again, on any worker
            if failure.reason is FailureReason.ENGINE_PAUSED and not attempts.progress.delivered:
                # Paused is not down (fleet.py): no move, no budget; the worker set took the
                # worker as paused, so the same request goes to one that takes new requests,
                # or waits while every worker is paused.
                self.paused_refusals += 1
                if self.paused_refusals > PAUSED_REFUSALS_LIMIT:
                    return failure
                if self.placed:
                    del self.tried[-len(self.placed) :]
                continue
            delivered = attempts.progress.delivered
            following = attempts.after_failure(failure)
            if isinstance(following, Finish):
                # The budget was spent before the terminal came: end it as LENGTH.
                await self.to.deliver(sub.index, attempts.finish(following))
                self._migration_outcome("length", failure)
                self.runner.retry_budget.succeeded(self.runner.clock())
                return None
            if isinstance(following, Refusal):
                if delivered:
                    self._migration_outcome(following.reason.name.lower(), failure)
                return failure
            # Only a busy answer's retry spends the budget: it is the one that multiplies an
            # overloaded fleet's load. A worker that went away (died, drained) leaves requests
            # whose retries are failover, bounded per request by --migration-limit; charging
            # them would fail a dead worker's requests just when the rest of the fleet can
            # take them (a worker killed under 300 streams: 34 of them answered 500 or 503).
            if not delivered and FAILURE_RULES[failure.reason].busy and not self._retry_allowed(failure):
                return failure
            current = following
            # Counted once another worker takes it (``_placed``), or as no_worker.
            self.moving = ("migrated" if delivered else "retry", failure)

    async def _after_unstarted(self, failure: WorkerFailure) -> bool:
        """The call was never started by its worker's server: pause (abortable), then the same
        request runs again, the worker it was sent to included (it did nothing wrong). False
        when the sub-request ran out of such retries (``Attempts.after_unstarted``). Neither the
        retry budget nor ``--migration-limit`` is charged: no engine saw the request."""
        sub = self.sub
        pause = sub.attempts.after_unstarted(self.runner.rand.random)
        if pause is None:
            return False
        if self.placed:
            del self.tried[-len(self.placed) :]
        self.moving = ("retry", failure)
        with anyio.CancelScope() as scope:
            sub.scope = scope
            await anyio.sleep(pause)
        sub.scope = None
        return True

    async def _after_preemption(
        self, cause: Preemption
    ) -> sidecar_pb2.PreprocessedRequest | WorkerFailure | None:
        """The current attempt was preempted: what runs once the request is readmitted, or how
        the sub-request ends now (None: every terminal had been delivered)."""
        runner, sub, attempts = self.runner, self.sub, self.sub.attempts
        if attempts.complete:
            runner.retry_budget.succeeded(runner.clock())
            return None
        worker = self.placed[-1] if self.placed else None
        if self.placed:
            # It did nothing wrong: the next attempt may go back to it.
            del self.tried[-len(self.placed) :]
        following = attempts.after_preemption()
        if isinstance(following, Finish):
            # The budget was spent before the terminal came: end it as LENGTH.
            await self.to.deliver(sub.index, attempts.finish(following))
            runner.retry_budget.succeeded(runner.clock())
            return None
        if isinstance(following, Refusal):
            # The handler allows preemption only for requests that can resume.
            why = following.reason.value
            return WorkerFailure.of(
                FailureReason.UNKNOWN,
                f"internal error in the frontend: a preempted request cannot resume ({why})",
            )
        self._paused(cause, worker)
        return following

    async def _resume(
        self, failure: WorkerFailure | None
    ) -> sidecar_pb2.PreprocessedRequest | WorkerFailure | None:
        """Its engine aborted it on its own and the client asked for it to go on: what runs
        next (the same request while nothing was delivered, else the continuation, its budget
        deducted), on any worker that takes new requests, the same one included, with no move
        counted; or how it ends now (None: done)."""
        runner, attempts = self.runner, self.sub.attempts
        self.resumes += 1
        worker = self.placed[-1] if self.placed else None
        if self.placed:
            del self.tried[-len(self.placed) :]
        following = attempts.after_preemption()
        if isinstance(following, Finish):
            await self.to.deliver(self.sub.index, attempts.finish(following))
            runner.retry_budget.succeeded(runner.clock())
            return None
        if isinstance(following, Refusal):
            return WorkerFailure.of(
                FailureReason.CANCELLED,
                f"its engine aborted the generation, which cannot resume ({following.reason.value})",
            )
        log.info(
            "request resumed after its engine aborted it",
            request_id=attempts.request.request_id,
            worker=worker,
            delivered_tokens=attempts.progress.completion_tokens(),
            resumes=self.resumes,
            why=failure.message if failure is not None else None,
        )
        return following

    def _may_resume(self) -> bool:
        sub = self.sub
        return (
            sub.resume_on_abort and not sub.aborted and sub.preempted is None and self.resumes < RESUME_LIMIT
        )

    def _paused(self, cause: Preemption, worker: str | None) -> None:
        self.paused_at = self.runner.clock()
        self.to.tally.preemptions += 1
        log.info(
            "request preempted",
            request_id=self.sub.attempts.request.request_id,
            worker=worker,
            delivered_tokens=self.sub.attempts.progress.completion_tokens(),
            urgency=cause.urgency,
            waiting_urgency=cause.waiting_urgency,
            waiting_secs=round(cause.waited, 3),
        )

    async def _until_readmitted(self) -> WorkerFailure | None:
        """Wait (abortable) until the request is admitted again; the failure the sub-request
        ends with when it never will be. Returns None also when the wait was cancelled (an
        abort, or a preemption again): the caller looks again."""
        cause = self.to.preemption
        if self.paused_at is None and cause is not None:
            # Preempted while between attempts (before its first one, say).
            self._paused(cause, None)
        with anyio.CancelScope() as scope:
            self.sub.scope = scope
            admitted = await self.to.readmit()
        self.sub.scope = None
        if scope.cancelled_caught:
            return None
        if not admitted:
            return WorkerFailure.of(FailureReason.NO_WORKER, "the frontend is shutting down")
        if self.paused_at is not None:
            log.info(
                "request resumed",
                request_id=self.sub.attempts.request.request_id,
                waited_secs=round(self.runner.clock() - self.paused_at, 3),
                delivered_tokens=self.sub.attempts.progress.completion_tokens(),
            )
            self.paused_at = None
        return None

    def _retry_allowed(self, failure: WorkerFailure) -> bool:
        """Whether the retry budget allows this retry (spent when it does); a refusal is
        counted and logged. A retry that then finds no worker has spent it all the same."""
        runner = self.runner
        if runner.retry_budget.try_retry(runner.clock()):
            return True
        if runner.metrics is not None:
            runner.metrics.retry_refused(self.to.format_name)
        log.info(
            "retry refused: the retry budget is spent",
            request_id=self.sub.attempts.request.request_id,
            worker=self.tried[-1] if self.tried else None,
            reason=failure.reason.value,
            error=failure.message,
        )
        return False

    def _migration_outcome(self, outcome: str, failure: WorkerFailure, to: str | None = None) -> None:
        metrics = self.runner.metrics
        if metrics is not None:
            metrics.migrated(self.to.format_name, outcome)
        attempts = self.sub.attempts
        log.info(
            "migration",
            request_id=attempts.request.request_id,
            outcome=outcome,
            worker=self.tried[-1] if self.tried else None,
            to=to,
            reason=failure.reason.value,
            error=failure.message,
            delivered_tokens=len(attempts.migration.delivered_tokens),
            migrations=attempts.migration.migrations,
        )

    def _placed(self, chosen: Sequence[Worker]) -> None:
        """A worker took the sub-request: the retry or migration decided after its last
        failure (if any) happened, and is counted now."""
        move, self.moving = self.moving, None
        if move is None:
            return
        kind, failure = move
        to = chosen[-1].address
        tally = self.to.tally
        if kind == "migrated":
            tally.migrations += 1
            self._migration_outcome("migrated", failure, to)
            return
        tally.retries += 1
        if self.runner.metrics is not None:
            self.runner.metrics.retried(self.to.format_name)
        log.info(
            "retrying on another worker",
            request_id=self.sub.attempts.request.request_id,
            worker=self.tried[-1] if self.tried else None,
            to=to,
            reason=failure.reason.value,
            error=failure.message,
        )

    async def _attempt(self, request: sidecar_pb2.PreprocessedRequest) -> WorkerFailure | None:
        """One attempt: aggregated, or prefill then decode when the set has prefill workers.
        A retry or a migration waits (bounded) for a worker to serve, unless it must not
        (``patient`` False: after a worker answered busy, see ``attempts.py``)."""
        runner, patient = self.runner, self.sub.attempts.patient
        chosen = await place(
            runner.workers,
            runner.choice,
            self.to.model,
            request,
            self.tried,
            patient=patient,
            wait=runner.config.worker_wait if self.tried and patient else 0.0,
        )
        if chosen is None:
            return WorkerFailure.of(FailureReason.NO_WORKER, runner.workers.no_worker_message(self.to.model))
        self.placed = tuple(w.address for w in chosen)
        self._placed(chosen)
        self.to.tally.workers.extend(w.address for w in chosen)
        self.tried.extend(w.address for w in chosen)
        if len(chosen) == 2:
            prefill, decode = chosen
            return await self._disaggregated(prefill, decode, request)
        return await self._decode(chosen[0], request)

    async def _decode(
        self,
        worker: Worker,
        request: sidecar_pb2.PreprocessedRequest,
        join: Callable[[sidecar_pb2.LLMEngineOutput], Awaitable[Fault | None]] | None = None,
    ) -> WorkerFailure | None:
        """A call whose outputs go to the client; None when every choice's terminal arrived.
        ``join``: what a disaggregated attempt adds to each output first (the prefill's part
        of the routed experts)."""
        attempts = self.sub.attempts
        model = worker.model
        vocab_size = model.vocab_size if model is not None else 0

        async def deliver(output: sidecar_pb2.LLMEngineOutput) -> WorkerFailure | None:
            if join is not None:
                fault = await join(output)
                if fault is not None:
                    return self.runner.misbehaved(worker, fault)
            cancelled = output.finish_reason == sidecar_pb2.CANCELLED
            resume = cancelled and worker.eligible and self._may_resume()
            if resume and _fills_budget(attempts, output):
                # Aborted once it had made its whole budget: nothing is left to resume, and the
                # answer is the one a moment later would have given (a LENGTH terminal, with
                # its spans and routed experts), not an empty continuation's.
                ended = sidecar_pb2.LLMEngineOutput()
                ended.CopyFrom(output)
                ended.finish_reason = sidecar_pb2.LENGTH
                output, cancelled, resume = ended, False, False
            if cancelled and (not worker.eligible or resume):
                # Nobody here aborted it: the worker is going away (drained, stopped) and its
                # engine ended the request, or its engine aborted it on its own (a pause) and
                # the client asked for it to go on. Not the client's abort: what came with it
                # is delivered (checked as the terminal-less output it becomes), the rest
                # continues (elsewhere, or once the fleet continues).
                partial = sidecar_pb2.LLMEngineOutput()
                partial.CopyFrom(output)
                for name in ("finish_reason", "stop_reason", "completion_usage", "engine_data"):
                    partial.ClearField(name)
                fault = self.check.check(partial, vocab_size)
                if fault is not None:
                    return self.runner.misbehaved(worker, fault)
                for piece in by_span(partial) if partial.token_ids else ():
                    failure = await self._give(worker, attempts.delivered(piece))
                    if failure is not None:
                        return failure
                if resume:
                    self.resuming = True
                    # As a pause's refusal: no fault of the worker's, and it is taken as paused
                    # until its next report says otherwise.
                    return WorkerFailure.of(
                        FailureReason.ENGINE_PAUSED,
                        f"worker {worker.address}: its engine aborted the generation (resumed, "
                        f"{RESUME_HEADER})",
                    )
                return WorkerFailure.of(
                    FailureReason.ENGINE_SHUTDOWN,
                    f"worker {worker.address} is going away: its engine aborted",
                )
            fault = self.check.check(output, vocab_size)
            if fault is not None:
                return self.runner.misbehaved(worker, fault)
            return await self._give(worker, attempts.delivered(output))

        failure = await self._call(worker, request, deliver, lambda: attempts.complete)
        if failure is None and not attempts.complete:
            failure = WorkerFailure.of(
                FailureReason.PROTOCOL_ERROR, f"worker {worker.address} ended the stream early"
            )
            self.runner.worker_failed(worker, failure)
        elif failure is None:
            self.runner.worker_succeeded(worker)
        return failure

    async def _disaggregated(
        self, prefill: Worker, decode: Worker, request: sidecar_pb2.PreprocessedRequest
    ) -> WorkerFailure | None:
        """Prefill on ``prefill``, decode on ``decode`` with its handoff. Whichever step fails
        first cancels the other (each cancelled call is aborted by its sidecar); a prefill the
        engine aborted ends the sub-request as cancelled, with no decode step."""
        runner = self.runner
        style = disagg.style_of(prefill.model)
        handoff: list[disagg.Handoff] = []
        ready = anyio.Event()
        prefill_failure: list[WorkerFailure] = []
        prefill_cancelled: list[sidecar_pb2.LLMEngineOutput] = []
        decode_failure: WorkerFailure | None = None
        options = request.output_options
        experts = pd_experts.LegExperts(len(request.token_ids), options.routed_experts_start_len)
        prefill_ended = anyio.Event()
        step = disagg.prefill_request(request)
        known = runner.bootstraps.get(prefill.address) if style is disagg.Style.BOOTSTRAP else None
        if known is not None:
            info = disagg.choose_bootstrap(known, runner.rand)
            step = disagg.prefill_request(request, info)
            handoff.append(info)
            ready.set()

        async def take(output: sidecar_pb2.LLMEngineOutput) -> WorkerFailure | None:
            experts.from_prefill(output)
            given = disagg.handoff_of(output)
            if given is not None and not handoff:
                handoff.append(given)
                if style is disagg.Style.BOOTSTRAP:
                    learned = disagg.bootstrap_address(given)
                    if learned is not None:
                        runner.bootstraps[prefill.address] = learned
                ready.set()
            elif output.finish_reason == sidecar_pb2.CANCELLED and not handoff:
                prefill_cancelled.append(output)
            return None

        async def run_prefill(group: TaskGroup) -> None:
            failure = await self._call(prefill, step, take)
            if failure is None and not handoff and not prefill_cancelled:
                failure = WorkerFailure.of(
                    FailureReason.PROTOCOL_ERROR, f"prefill worker {prefill.address} gave no handoff"
                )
                runner.worker_failed(prefill, failure)
            elif failure is None and handoff:
                runner.worker_succeeded(prefill)
            if failure is not None:
                prefill_failure.append(failure)
                group.cancel_scope.cancel()
            prefill_ended.set()
            ready.set()

        async def join(output: sidecar_pb2.LLMEngineOutput) -> Fault | None:
            # The prefill's rows come on its terminal, which may reach us after the decode's.
            if experts.needs_prefill(output):
                await prefill_ended.wait()
            mismatch = experts.into_decode(output)
            if mismatch is None:
                return None
            return Fault(Misbehaviour.UNENCODABLE_OUTPUT, f"{mismatch.detail} (prefill {prefill.address})")

        async with anyio.create_task_group() as group:
            group.start_soon(run_prefill, group)
            await ready.wait()
            if handoff:
                decode_failure = await self._decode(
                    decode,
                    disagg.decode_request(request, handoff[0]),
                    join if options.return_routed_experts else None,
                )
                if decode_failure is not None:
                    group.cancel_scope.cancel()
        if prefill_failure:
            return prefill_failure[0]
        if prefill_cancelled and not handoff:
            cancelled = prefill_cancelled[0]
            model = prefill.model
            fault = self.check.check(cancelled, model.vocab_size if model is not None else 0)
            if fault is not None:
                return runner.misbehaved(prefill, fault)
            return await self._give(prefill, self.sub.attempts.delivered(cancelled))
        return decode_failure

    async def _give(self, worker: Worker, output: sidecar_pb2.LLMEngineOutput) -> WorkerFailure | None:
        """``output`` (in the client's terms) to the client; the worker's failure when the
        format could not take it. A preemption waits until it was written: it is recorded as
        delivered already, so a write cut short would lose it for the client."""
        sub = self.sub
        sub.delivering = True
        try:
            await self.to.deliver(sub.index, output)
        except OutputNotEncoded as err:
            return self.runner.misbehaved(worker, Fault(Misbehaviour.UNENCODABLE_OUTPUT, str(err)))
        finally:
            sub.delivering = False
        if sub.preempted is not None and sub.scope is not None:
            sub.scope.cancel()  # the preemption held while the output was written
        return None

    async def _call(
        self,
        worker: Worker,
        request: sidecar_pb2.PreprocessedRequest,
        consume: Callable[[sidecar_pb2.LLMEngineOutput], Awaitable[WorkerFailure | None]],
        done: Callable[[], bool] | None = None,
    ) -> WorkerFailure | None:
        """One Generate call on ``worker``, each output to ``consume``; the call's failure, if any.
        Once ``done()`` (every terminal was delivered) the call is left (after ``end_grace`` at
        most: :meth:`_after_final`). Leaving early (a cancel) cancels the call, and the sidecar
        aborts the engine request."""
        runner = self.runner
        timeout = runner.config.request_timeout
        grpc_timeout = None if timeout is None else timeout + _GRPC_DEADLINE_SLACK
        metrics = runner.metrics
        began = runner.clock()
        first = True
        failure: WorkerFailure | None = None
        try:
            with (
                worker.lease(runner.lease_changed),
                runner.watch.watch(worker, request)
                if runner.watch is not None
                else nullcontext(_ignore) as observe,
                runner.tracing.span(
                    "sidecar.v1.Worker/Generate",
                    kind=SpanKind.CLIENT,
                    attributes={"server.address": worker.address, "llm.request_id": request.request_id},
                ),
            ):
                gate = worker.start_gate(runner.config.start_slots)
                if gate is not None:
                    await gate.acquire()
                call = worker.stub().Generate(request, timeout=grpc_timeout, metadata=outgoing_metadata())
                if request.output_options.unary:
                    self.sub.unary_call = (worker, request.request_id)
                try:
                    # Until its first output, the call holds one of the worker's start slots:
                    # what waits beyond them waits here, not in the worker's gRPC server (which
                    # refuses calls past its limits and drops one that waited 30 s). A call
                    # that fails bare before any output was never taken by the sidecar
                    # (NOT_STARTED: no engine saw it, it may run again).
                    outputs = aiter(call)
                    async for output in outputs:
                        if output is None:
                            # grpc.aio's answer to a message that does not decode (it logs
                            # "Exception deserializing message!", naming no worker).
                            failure = runner.misbehaved(
                                worker,
                                Fault(
                                    Misbehaviour.UNDECODABLE_OUTPUT, "a Generate output that does not decode"
                                ),
                            )
                            return failure
                        observe(output)
                        if first:
                            first = False
                            if gate is not None:
                                gate.release()
                                gate = None
                            if metrics is not None:
                                metrics.worker_first_output(worker.address, runner.clock() - began)
                        failure = await consume(output)
                        if failure is not None:
                            return failure
                        if done is not None and done():
                            await self._after_final(worker, outputs)
                            return None
                except grpc.RpcError as err:
                    # Only a sidecar that types every failure of the calls it took says anything
                    # with a bare status: an older one is read as before.
                    known = not first if worker.failures_typed else None
                    read = read_rpc_error(err, started=known)
                    failure = read if isinstance(read, WorkerFailure) else runner.misbehaved(worker, read)
                    return failure
                except asyncio.CancelledError:
                    if cancel_is_ours():
                        raise
                    # grpc.aio ended the call under us (its channel closed): a broken call.
                    failure = WorkerFailure.of(
                        FailureReason.CANNOT_CONNECT,
                        f"worker {worker.address}: the Generate call was cancelled under us "
                        "(its connection closed)",
                    )
                    return failure
                finally:
                    self.sub.unary_call = None
                    if gate is not None:
                        gate.release()
                    # A no-op once the stream ended; otherwise the sidecar aborts the engine request.
                    call.cancel()
            return None
        finally:
            if metrics is not None:
                metrics.worker_call(worker.address, runner.clock() - began)
            if failure is not None:
                runner.worker_failed(worker, failure)

    async def _after_final(
        self, worker: Worker, outputs: AsyncIterator[sidecar_pb2.LLMEngineOutput | None]
    ) -> None:
        """Every terminal was delivered: the worker's stream should end now. Whatever it does
        instead is not the client's concern: anything it sends is reported and dropped, a
        failed status is the sidecar's own business (it counts a call whose terminals were all
        delivered as a success), and a stream still open after ``end_grace`` is left (the
        caller cancels it)."""
        runner = self.runner
        with anyio.move_on_after(runner.end_grace) as waited:
            try:
                async for extra in outputs:
                    kind = (
                        Misbehaviour.UNDECODABLE_OUTPUT if extra is None else Misbehaviour.OUTPUT_AFTER_FINAL
                    )
                    runner.misbehaviour.report(worker.address, kind, "a Generate output after every terminal")
                    return
            except grpc.RpcError as err:
                log.debug(
                    "worker's stream failed after its final output",
                    worker=worker.address,
                    request_id=self.sub.attempts.request.request_id,
                    error=repr(err),
                )
                return
            except asyncio.CancelledError:
                if cancel_is_ours():
                    raise  # the grace ran out (this scope), or the request is being cancelled
                return  # its connection closed under it: the answer was complete already
        if waited.cancelled_caught:
            log.debug(
                "worker kept its stream open after the final output: call cancelled",
                worker=worker.address,
                request_id=self.sub.attempts.request.request_id,
                waited_secs=runner.end_grace,
            )


def _fills_budget(attempts: Attempts, output: sidecar_pb2.LLMEngineOutput) -> bool:
    """``output``'s tokens make up what is left of the request's ``max_tokens``."""
    stop = attempts.request.stop_conditions
    if not stop.HasField("max_tokens"):
        return False
    return attempts.progress.completion_tokens() + len(output.token_ids) >= stop.max_tokens


def _ignore(output: sidecar_pb2.LLMEngineOutput) -> None:
    """A call nobody watches."""
