"""The project's one retry mechanism: tenacity, with one backoff rule.

:class:`Backoff` is the pause between attempts everywhere: exponential from ``initial``,
capped at ``cap``, with "equal jitter" (uniform in the upper half of the current step), so that
many clients failing together (a pool's connections, a fleet restarting against etcd) do not
retry in lockstep. The connection pool drives tenacity with it until a deadline
(:func:`sidecar_common.pool.retry_until_deadline`); :class:`RetryForever` drives it with no
deadline, for the background loops that must outlive any outage (a sidecar's etcd
registration, the frontend's etcd discovery).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeVar

import anyio
import tenacity

__all__ = ["Backoff", "RetryForever"]

T = TypeVar("T")

_MAX_EXPONENT: Final = 62  # 2**62 times any initial pause already exceeds any cap


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with equal jitter (see the module doc)."""

    initial: float
    cap: float

    def ceiling(self, failures: int) -> float:
        """The longest pause after the ``failures``-th failure in a row (1 for the first)."""
        exponent = min(max(failures - 1, 0), _MAX_EXPONENT)
        return min(self.cap, self.initial * (2.0**exponent))

    def pause(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """The pause after the ``failures``-th failure in a row: uniform in [ceiling/2,
        ceiling]. ``rand`` (uniform in [0, 1)) drives the jitter; tests fix it."""
        return self.ceiling(failures) * (0.5 + 0.5 * rand())


class RetryForever:
    """Attempts until one returns (or ``stop()`` says so after a failure), pausing by a
    :class:`Backoff` between them.

    Only failures ``retry_on`` accepts are retried; any other exception (and cancellation)
    ends the loop at once and propagates. ``on_retry(error, failures, pause)`` is told of each
    failure that will be retried, before the pause (the caller logs it; ``failures`` counts
    the failures in a row, 1 for the first). An attempt that got somewhere before failing (a
    registration that was in place, a watch that was in sync) calls :meth:`made_progress`:
    its failure is then the first of a new series, with the first pause again. When
    ``stop()`` is true after a failure, that failure is raised instead of retried.
    ``sleep`` waits the pause (a caller may end it early, e.g. when asked to stop).
    """

    def __init__(
        self,
        backoff: Backoff,
        *,
        retry_on: Callable[[BaseException], bool],
        on_retry: Callable[[BaseException, int, float], None],
        stop: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._backoff = backoff
        self._retry_on = retry_on
        self._on_retry = on_retry
        self._stop = stop
        self._sleep = sleep
        self._rand = rand
        self._failures = 0

    def made_progress(self) -> None:
        """The current attempt succeeded at something: the next failure starts a new series."""
        self._failures = 0

    async def run(self, attempt: Callable[[], Awaitable[T]]) -> T:
        self._failures = 0
        retrying = tenacity.AsyncRetrying(
            sleep=self._sleep,
            wait=self._wait,
            stop=lambda _: self._stop(),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, Exception) and self._retry_on(e)),
            before_sleep=self._before_sleep,
            reraise=True,
        )
        return await retrying(attempt)

    def _wait(self, retry_state: tenacity.RetryCallState) -> float:
        self._failures += 1
        return self._backoff.pause(self._failures, self._rand)

    def _before_sleep(self, retry_state: tenacity.RetryCallState) -> None:
        error = retry_state.outcome.exception() if retry_state.outcome is not None else None
        pause = retry_state.next_action.sleep if retry_state.next_action is not None else 0.0
        if error is not None:
            self._on_retry(error, self._failures, pause)
