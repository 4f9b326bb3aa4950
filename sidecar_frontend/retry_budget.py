"""The retry budget: how many retries across workers the frontend may add to its fleet's load.

Issue 27 ("Overload"): a sub-request a worker failed before anything was delivered runs again
on another worker (``attempts.py``), an engine's busy refusal (OVERLOADED) included. Unbounded,
an overloaded fleet would multiply its own load: every refused request comes back as several.
So every such retry first asks the :class:`RetryBudget`, one per frontend, which allows
``ratio`` retries per sub-request that completed recently, plus ``min_per_second`` retries per
second whatever the successes (a quiet fleet, or one that just started, can still retry).

Pure: no I/O, no clock (each call is given ``now``, in seconds of a monotonic clock), no
logging. The history is bucketed: the ``window`` is cut into :data:`BUCKETS` buckets of
``window / BUCKETS`` seconds. A retry at time ``t`` is allowed when, counting it, the retries
of the current bucket and the :data:`BUCKETS` before it (at least the last ``window`` seconds)
are at most ``ratio`` times the successes of the current bucket and the ``BUCKETS - 1`` before
it (at most the last ``window`` seconds) plus ``min_per_second * window``. Both spans err on
the side of fewer retries, so at every allowed retry::

    retries in [t - window, t] <= ratio * successes in (t - window, t] + min_per_second * window
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

__all__ = ["BUCKETS", "RetryBudget", "RetryBudgetSettings"]

# How many buckets a window is cut into: finer forgets sooner after a burst, coarser costs less.
BUCKETS: Final = 10


@dataclass(frozen=True)
class RetryBudgetSettings:
    """How many retries across workers the frontend may make (see the module docstring)."""

    # Retries allowed per sub-request that completed within the window.
    ratio: float = 0.2
    # Retries per second always allowed, so a quiet fleet can still retry.
    min_per_second: float = 5.0
    # Seconds of history the budget counts.
    window: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio >= 0):
            raise ValueError(f"ratio must be a finite number >= 0, got {self.ratio}")
        if not (math.isfinite(self.min_per_second) and self.min_per_second >= 0):
            raise ValueError(f"min_per_second must be a finite number >= 0, got {self.min_per_second}")
        if not (math.isfinite(self.window) and self.window > 0):
            raise ValueError(f"window must be a finite number > 0, got {self.window}")

    @property
    def reserve(self) -> float:
        """The retries a window allows with no success at all."""
        return self.min_per_second * self.window


@dataclass
class _Bucket:
    index: int = -1  # which bucket of time it holds (floor(now / width)); -1: none yet
    successes: int = 0
    retries: int = 0


class RetryBudget:
    """Allows retries as a fraction of recent successes (see the module docstring)."""

    def __init__(self, settings: RetryBudgetSettings | None = None) -> None:
        self.settings = settings if settings is not None else RetryBudgetSettings()
        self._width = self.settings.window / BUCKETS
        # One more than a window's worth: the retries' span is a bucket longer than the successes'.
        self._ring = [_Bucket() for _ in range(BUCKETS + 1)]
        self._latest = -math.inf

    def succeeded(self, now: float) -> None:
        """A sub-request completed (every terminal delivered) at ``now``."""
        self._bucket(now).successes += 1

    def try_retry(self, now: float) -> bool:
        """Whether a retry at ``now`` is within the budget; when it is, it is spent."""
        current = self._bucket(now)
        retries = sum(b.retries for b in self._ring if b.index > current.index - BUCKETS - 1)
        successes = sum(b.successes for b in self._ring if b.index > current.index - BUCKETS)
        if retries + 1 > self.settings.ratio * successes + self.settings.reserve:
            return False
        current.retries += 1
        return True

    def _bucket(self, now: float) -> _Bucket:
        """The bucket of ``now``, emptied first when it last held an older one. A clock that
        steps back counts as the latest time seen, so no bucket is counted twice."""
        self._latest = max(self._latest, now)
        index = math.floor(self._latest / self._width)
        bucket = self._ring[index % len(self._ring)]
        if bucket.index != index:
            bucket.index, bucket.successes, bucket.retries = index, 0, 0
        return bucket
