"""What happens to the worker set, told to whoever subscribes: routing, metrics, logs, waiters.

Three events, each with the worker it concerns:

- ``joined``: a worker was added (discovery, a ``--worker`` flag); nothing is known of it yet.
- ``changed``: its state, model, refusal or ejection changed, or its connections were replaced.
- ``left``: it was drained and forgotten; whatever is kept about it can go.

A listener is told synchronously, in subscription order, from the task that made the change;
it must not block (start a task for anything long). A listener that raises is logged with the
worker's address and the event, and the others are still told. :meth:`WorkerEvents.next_change`
is the same news for a task that waits: an event set at the next change of any kind (taken
before looking, so no change between the look and the wait is missed).

Apart from those, a *load listener* (:meth:`WorkerEvents.subscribe_load`) is told each load
report believed from a worker (its figures were just set). A report is not a change: routing
reads the figures where it uses them, and the change waiters are not woken by every report; but
admission looks at its queue again at once, for the room a report may have freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import anyio
import structlog

__all__ = ["WorkerEvents", "WorkerListener"]

log = structlog.get_logger("sidecar_frontend.workers")


class _Addressed(Protocol):
    @property
    def address(self) -> str: ...


# The worker record (the registry's Worker): generic here so that this module, which the
# registry imports, imports nothing of the registry.
WorkerT = TypeVar("WorkerT", bound=_Addressed)
WorkerT_contra = TypeVar("WorkerT_contra", bound=_Addressed, contravariant=True)
_L = TypeVar("_L")  # a listener of either kind


class WorkerListener(Protocol[WorkerT_contra]):
    def joined(self, worker: WorkerT_contra) -> None: ...

    def changed(self, worker: WorkerT_contra) -> None: ...

    def left(self, worker: WorkerT_contra) -> None: ...


class WorkerEvents(Generic[WorkerT]):
    def __init__(self) -> None:
        self._listeners: list[WorkerListener[WorkerT]] = []
        self._load_listeners: list[Callable[[WorkerT], None]] = []
        self._next = anyio.Event()

    def subscribe(self, listener: WorkerListener[WorkerT]) -> Callable[[], None]:
        """Tell ``listener`` every event from now on; the returned call unsubscribes it."""
        return _added(self._listeners, listener)

    def subscribe_load(self, listener: Callable[[WorkerT], None]) -> Callable[[], None]:
        """Tell ``listener`` each load report believed from now on; the returned call
        unsubscribes it."""
        return _added(self._load_listeners, listener)

    def loaded(self, worker: WorkerT) -> None:
        """A load report of ``worker`` was believed (its figures are set)."""
        for listener in tuple(self._load_listeners):
            try:
                listener(worker)
            except Exception:  # one listener's fault must not keep the news from the others
                log.exception("worker load listener failed", worker=worker.address)

    def next_change(self) -> anyio.Event:
        return self._next

    def joined(self, worker: WorkerT) -> None:
        self._tell("joined", worker)

    def changed(self, worker: WorkerT) -> None:
        self._tell("changed", worker)

    def left(self, worker: WorkerT) -> None:
        self._tell("left", worker)

    def _tell(self, event: str, worker: WorkerT) -> None:
        for listener in tuple(self._listeners):
            try:
                getattr(listener, event)(worker)
            except Exception:  # one listener's fault must not keep the news from the others
                log.exception("worker event listener failed", worker_event=event, worker=worker.address)
        fired, self._next = self._next, anyio.Event()
        fired.set()


def _added(listeners: list[_L], listener: _L) -> Callable[[], None]:
    """Append ``listener``; the returned call removes it (once, and only if still there)."""
    listeners.append(listener)

    def remove() -> None:
        if listener in listeners:
            listeners.remove(listener)

    return remove
