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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

if TYPE_CHECKING:
    from sidecar_frontend.registry import Worker

__all__ = ["WorkerEvents", "WorkerListener"]

log = structlog.get_logger("sidecar_frontend.workers")


class WorkerListener(Protocol):
    def joined(self, worker: Worker) -> None: ...

    def changed(self, worker: Worker) -> None: ...

    def left(self, worker: Worker) -> None: ...


class WorkerEvents:
    def __init__(self) -> None:
        self._listeners: list[WorkerListener] = []
        self._next = anyio.Event()

    def subscribe(self, listener: WorkerListener) -> Callable[[], None]:
        """Tell ``listener`` every event from now on; the returned call unsubscribes it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def next_change(self) -> anyio.Event:
        return self._next

    def joined(self, worker: Worker) -> None:
        self._tell("joined", worker)

    def changed(self, worker: Worker) -> None:
        self._tell("changed", worker)

    def left(self, worker: Worker) -> None:
        self._tell("left", worker)

    def _tell(self, event: str, worker: Worker) -> None:
        for listener in tuple(self._listeners):
            try:
                getattr(listener, event)(worker)
            except Exception:  # one listener's fault must not keep the news from the others
                log.exception("worker event listener failed", worker_event=event, worker=worker.address)
        fired, self._next = self._next, anyio.Event()
        fired.set()
