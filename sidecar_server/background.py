"""Background tasks with an owner: none outlives the object that started them.

The server's health watch and its probing after an engine fault run beside the requests, not
inside any one of them, so no request's cancel scope can own them. This object does: every such
task is started through it (none once it is closed), and :meth:`BackgroundTasks.close` cancels
them all and waits for them within a deadline. A task that fails is logged, not lost with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import structlog

__all__ = ["BackgroundTasks"]

_log = structlog.get_logger(__name__)
T = TypeVar("T")


class BackgroundTasks:
    """The background tasks of one owner (``owner`` names it in task names and log lines)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def running(self) -> int:
        """Tasks started and not finished yet."""
        return len(self._tasks)

    def spawn(self, run: Callable[[], Coroutine[Any, Any, T]], name: str) -> asyncio.Task[T] | None:
        """Start ``run()`` as a task of this owner; None (nothing started) once closed."""
        if self._closed:
            return None
        task = asyncio.get_running_loop().create_task(run(), name=f"{self._owner}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            _log.error("background task failed", task=task.get_name(), error=repr(error), exc_info=error)

    async def close(self, timeout: float) -> None:
        """Start nothing more; cancel every task and wait for them, at most ``timeout`` seconds
        (shielded: a cancelled caller still leaves no task behind that could finish in time)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        with anyio.CancelScope(shield=True):
            # asyncio.wait, not gather under a timeout: a gather cut short cancels its tasks
            # again and then waits for them all, however long one that ignores it takes.
            await asyncio.wait(tasks, timeout=timeout)
        left = sorted(task.get_name() for task in tasks if not task.done())
        if left:
            _log.warning("background tasks still running after stop", tasks=left, timeout=timeout)
