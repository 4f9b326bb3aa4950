"""Where an attempt runs: the prefill and decode workers, or the aggregated worker, it takes.

A routing policy plugs in as a :class:`WorkerChoice`: asked for one worker of a role at a time,
it answers from the serving workers it is offered (the default, :func:`least_loaded`, is the
worker set's power of two choices; ``sidecar_frontend/routing/`` is the KV-cache-aware one). A
policy may also follow the calls it chose the workers of (:class:`CallWatch`). :func:`place` is
what the attempt runner calls: it asks the choice for the roles the fleet serves, prefers a
worker the sub-request has not tried, and waits (bounded) for one to serve when none does, or
for one to take new requests while the model's workers are all paused (``fleet.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Protocol

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import Role
from sidecar_frontend.fleet import placement_wait
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["CallWatch", "Observe", "Placement", "WorkerChoice", "least_loaded", "place"]

# One aggregated worker, or a prefill worker and a decode worker.
Placement = tuple[Worker] | tuple[Worker, Worker]


class WorkerChoice(Protocol):
    """A routing policy: a SERVING worker of ``role`` serving ``model`` for ``request``, never
    one whose address is in ``exclude``; None when there is no such worker. Called once per
    role per attempt, so it may count what it chose."""

    def __call__(
        self,
        role: Role,
        model: str,
        request: sidecar_pb2.PreprocessedRequest,
        exclude: frozenset[str],
    ) -> Worker | None: ...


# Given each output of a call, as the worker sent it.
Observe = Callable[[sidecar_pb2.LLMEngineOutput], None]


class CallWatch(Protocol):
    """What a routing policy follows of a Generate call: entered when the call starts, left
    when it ends (however), its function given each output the worker sent."""

    def watch(
        self, worker: Worker, request: sidecar_pb2.PreprocessedRequest
    ) -> AbstractContextManager[Observe]: ...


def least_loaded(workers: WorkerSet) -> WorkerChoice:
    """The default choice: the worker set's power of two choices over load."""

    def choose(
        role: Role, model: str, request: sidecar_pb2.PreprocessedRequest, exclude: frozenset[str]
    ) -> Worker | None:
        return workers.pick(role, exclude=exclude, model=model)

    return choose


# Set by a worker choice that declined a request because the one worker it should take (a
# session's) is paused or behind the newest weight version, and should take new requests again
# shortly: the anyio time until which placement waits for it (routing/sessions_choice.py).
# None: no such wait. Per request (its task's context).
WAIT_FOR_OWN_WORKER: ContextVar[float | None] = ContextVar(
    "sidecar_frontend_wait_for_own_worker", default=None
)


async def place(
    workers: WorkerSet,
    choice: WorkerChoice,
    model: str,
    request: sidecar_pb2.PreprocessedRequest,
    tried: Sequence[str],
    *,
    patient: bool,
    wait: float,
) -> Placement | None:
    """A prefill and a decode worker while both roles serve ``model``, else an aggregated one;
    None when none serves within ``wait`` seconds (0: only what serves now), or, while the
    model's fleet is held (its workers paused, or none at the newest weight version:
    ``fleet.py``), within the worker set's ``paused_hold``. A worker in ``tried`` is taken only
    when no other serves and ``patient`` (any but the last one that failed: a restarted worker
    comes back under its old address)."""

    def pick(role: Role) -> Worker | None:
        worker = choice(role, model, request, frozenset(tried))
        if worker is None and tried and patient:
            worker = choice(role, model, request, frozenset(tried[-1:]))
        return worker

    started = anyio.current_time()
    with anyio.CancelScope() as bounded:
        while True:
            changed = workers.next_change()
            if workers.has_serving("prefill", model) and workers.has_serving("decode", model):
                prefill = pick("prefill")
                decode = pick("decode")
                if prefill is not None and decode is not None:
                    return prefill, decode
            worker = pick("agg")
            if worker is not None:
                return (worker,)
            # The bound is looked at anew at each change: a fleet that becomes held (or stops
            # being held) while this waits changes how long it may wait.
            own = WAIT_FOR_OWN_WORKER.get()
            if own is not None and own > anyio.current_time():
                # The choice waits for its own worker until then; past it, it chooses anew.
                with anyio.CancelScope(deadline=own):
                    await changed.wait()
                continue
            bounded.deadline = started + placement_wait(
                wait, workers.paused_hold, fleet_held=workers.held(model)
            )
            await changed.wait()
    return None
