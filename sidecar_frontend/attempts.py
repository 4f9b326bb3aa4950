"""What to run after a worker failed a sub-request, and how a worker's failure reads.

Pure: :class:`Attempts` is the one place that decides whether a failed sub-request runs again
and with what. Two cases, one budget (``--migration-limit`` moves per sub-request):

* nothing was delivered yet: the same request runs again on another worker when the failure
  is one another worker may not repeat (its rule in ``sidecar_common.errors.FAILURE_RULES``
  says ``retried``, or the sidecar marked it migratable, or the worker misbehaved; the client
  has seen nothing, so nothing can be duplicated); at least one such retry is allowed even
  with migration off;
* tokens were delivered: :class:`~sidecar_frontend.migration.Migration` continues the
  generation from them when the sidecar marked the failure migratable.

Where the next attempt may run (:attr:`Attempts.patient`): after a worker went away it may wait
(bounded) for one to serve, the same one back included; after a worker answered busy
(OVERLOADED, whose rule says ``busy``) that worker is still there, so only a worker that serves
now and has not answered this sub-request busy may take it, and none is waited for: with no
such worker the client gets the busy answer at once, as from the engine itself.

What is decided here is what a sub-request may do on its own. Across sub-requests, retries are
bounded too: the attempt runner asks the frontend's retry budget (``retry_budget.py``) before
each retry decided here, and ends the sub-request with its failure when the budget refuses
(migrations are not charged: the limit above bounds them).

A call the worker's gRPC server never handed to its sidecar (NOT_STARTED: too many calls were
waiting there, or one waited too long) is no worker's failure either, and reached no engine:
:meth:`Attempts.after_unstarted` gives the pause before the same request runs again (on any
worker, the same one included), doubling from :data:`UNSTARTED_BACKOFF`'s first pause to its cap,
at most :data:`UNSTARTED_LIMIT` times; no move is counted.

An attempt the frontend stopped itself (admission preempted the request, ``admission/``) is no
worker's failure: :meth:`Attempts.after_preemption` runs the same request again while nothing
was delivered, else the continuation, and neither counts as a move.

Every output the client is given passes through :meth:`Attempts.delivered`, which rewrites a
continuation's outputs so that the client sees one uninterrupted generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import grpc
from google.protobuf.message import DecodeError

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FAILURE_RULES, FailureReason, decode_rpc_error
from sidecar_common.retry import Backoff
from sidecar_frontend.formats.base import WorkerFailure
from sidecar_frontend.migration import DEFAULT_MIGRATION_LIMIT, Finish, Migration, Refusal, RefusalReason
from sidecar_frontend.misbehaviour import Fault, Misbehaviour

__all__ = [
    "UNSTARTED_BACKOFF",
    "UNSTARTED_LIMIT",
    "Attempts",
    "Finish",
    "Progress",
    "Refusal",
    "RefusalReason",
    "failure_from_rpc_error",
    "misbehaved",
    "read_rpc_error",
]


# A call its worker's server never started runs again after a pause from 50 ms doubling to 1 s,
# at most 30 times (about 25 s of pauses): a sidecar that takes no call for that long is not
# busy but stuck, and the client gets the busy answer (503) rather than waiting on.
UNSTARTED_BACKOFF: Final = Backoff(initial=0.05, cap=1.0)
UNSTARTED_LIMIT: Final = 30


@dataclass
class Progress:
    """What one sub-request has delivered to the encoder so far, over every attempt."""

    outputs: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def observe(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        self.outputs += 1
        index = output.index
        if output.token_ids:
            self.tokens.setdefault(index, []).extend(output.token_ids)
        if output.finish_reason != sidecar_pb2.UNSPECIFIED:
            self.finished.add(index)

    @property
    def delivered(self) -> bool:
        return self.outputs > 0

    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


class Attempts:
    """One sub-request across its attempts: what the client was given, what runs next."""

    def __init__(
        self, request: sidecar_pb2.PreprocessedRequest, migration_limit: int = DEFAULT_MIGRATION_LIMIT
    ) -> None:
        self.request = request
        self.limit = migration_limit
        self.progress = Progress()
        self.migration = Migration(request, migration_limit)
        self.retries = 0  # moves before anything was delivered
        self.unstarted = 0  # calls a worker's server never started (not moves)
        self._last_failure: WorkerFailure | None = None

    @property
    def moves(self) -> int:
        """How many times the sub-request moved to another worker."""
        return self.retries + self.migration.migrations

    @property
    def patient(self) -> bool:
        """Whether the next attempt may wait for a worker to serve and go back to one that
        failed it (False after OVERLOADED: see the module docstring)."""
        return self._last_failure is None or not FAILURE_RULES[self._last_failure.reason].busy

    @property
    def choices(self) -> int:
        options = self.request.sampling_options
        return max(options.n, 1) if options.HasField("n") else 1

    @property
    def complete(self) -> bool:
        """Every choice's terminal was delivered."""
        return len(self.progress.finished) >= self.choices

    def delivered(self, output: sidecar_pb2.LLMEngineOutput) -> sidecar_pb2.LLMEngineOutput:
        """Record an output of the current attempt; return it as the client must see it."""
        out = self.migration.delivered(output)
        self.progress.observe(out)
        return out

    def finish(self, finish: Finish) -> sidecar_pb2.LLMEngineOutput:
        """Record the terminal of a :class:`Finish` (already in the client's terms)."""
        self.progress.observe(finish.terminal)
        return finish.terminal

    def after_failure(self, failure: WorkerFailure) -> sidecar_pb2.PreprocessedRequest | Refusal | Finish:
        """The current attempt failed: the request to run next, or why there is none."""
        self._last_failure = failure
        if not self.progress.delivered:
            # A worker that misbehaved says nothing true of the request: another may take it.
            retried = failure.misbehaved or FAILURE_RULES[failure.reason].retried
            if not failure.migratable and not retried:
                return Refusal(RefusalReason.NOT_MIGRATABLE)
            if self.moves >= max(self.limit, 1):
                return Refusal(RefusalReason.LIMIT)
            self.retries += 1
            return self.request
        if failure.migratable and not self.migration.finished and self.moves >= self.limit:
            return Refusal(RefusalReason.LIMIT)
        return self.migration.after_failure(failure.migratable)

    def after_unstarted(self, rand: Callable[[], float]) -> float | None:
        """The current attempt's call was never started by its worker's server (NOT_STARTED):
        the pause before the same request runs again, or None when it ran out of such retries.
        No move is counted and the last failure is forgotten (the next attempt may take any
        worker, the same one included). ``rand`` (uniform in [0, 1)) jitters the pause."""
        if self.unstarted >= UNSTARTED_LIMIT:
            return None
        self.unstarted += 1
        self._last_failure = None
        return UNSTARTED_BACKOFF.pause(self.unstarted, rand)

    def after_preemption(self) -> sidecar_pb2.PreprocessedRequest | Refusal | Finish:
        """The current attempt was preempted: the request to run next once readmitted (the same
        one while nothing was delivered, else the continuation), or why there is none. No move
        is counted, and the next attempt may go to any worker, the same one included."""
        self._last_failure = None
        if not self.progress.delivered:
            return self.request
        return self.migration.after_preemption()


def read_rpc_error(error: grpc.RpcError, started: bool | None = None) -> WorkerFailure | Fault:
    """A failed Generate call as the sidecar typed it (see
    :func:`~sidecar_common.errors.decode_rpc_error`; ``started``: whether an output came, for
    a sidecar that types every failure of its calls, else None), or the worker's fault when its
    status details (a
    ``google.rpc.Status``, its ``ErrorInfo``) do not decode: such a status says nothing the
    frontend can act on, so it is refused rather than read."""
    try:
        return WorkerFailure.from_error(decode_rpc_error(error, started=started))
    except DecodeError as err:
        return Fault(Misbehaviour.UNDECODABLE_STATUS, f"a status whose details do not decode ({err})")


def failure_from_rpc_error(error: grpc.RpcError, address: str = "") -> WorkerFailure:
    """:func:`read_rpc_error`, a fault as the failure it ends the call with (:func:`misbehaved`)."""
    read = read_rpc_error(error)
    return read if isinstance(read, WorkerFailure) else misbehaved(address or "(unnamed)", read)


def misbehaved(address: str, fault: Fault) -> WorkerFailure:
    """The failure of a call whose worker misbehaved: the worker's protocol error, which
    another worker may take while nothing was delivered (``WorkerFailure.misbehaved``), and
    never migrated after (the delivered tokens came from a worker that cannot be trusted to
    have sent them right, so no continuation builds on them)."""
    return WorkerFailure(
        FailureReason.PROTOCOL_ERROR,
        f"worker {address} misbehaved: {fault.detail}",
        migratable=False,
        misbehaved=True,
    )
