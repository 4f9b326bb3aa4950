"""The cyclic collector's thresholds in the frontend: one set while serving, a tighter young
threshold while requests wait for admission.

The young threshold counts tracked objects allocated less those freed, so what reference
counting frees (nearly all of a request's objects) never adds up to it. Serving, 50,000: at
CPython's 700 the thousands of objects of the requests in flight trip it every few requests,
every pass promotes them, and a full pass walks them all every second or two: about a third of
the frontend's CPU at 2,000 non-streaming requests in flight (docs/decisions.md, "Per-request
CPU"). At most 50,000 objects of cyclic garbage wait.

While requests wait for admission (a backlog: the fleet is full), their live objects (about 100
each: aiohttp's request and handler, the wait) fill the young generation and a pass walks
them all, 17-27 ms under bench.overload's flood at 8 x, every admitted stream stopped meanwhile.
A young threshold of 10,000 makes those passes 4-6.5 ms there; it is not kept while serving
because it costs throughput where nothing waits (bench.rollout: 6.7 against 5.9 µs of frontend
CPU per token, docs/decisions.md). With a backlog the engines are the limit, not the frontend's
CPU, and what the admitted streams wait for is what matters.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Final

SERVING_THRESHOLDS: Final = (50_000, 20, 10)
BACKLOG_THRESHOLDS: Final = (10_000, 20, 10)


class CollectorThresholds:
    """Sets the serving thresholds, and the backlog ones between ``backlog(True)`` and
    ``backlog(False)`` (the admission gate's ``on_backlog``)."""

    def __init__(self, set_threshold: Callable[..., None] = gc.set_threshold) -> None:
        self._set = set_threshold
        self._backlog = False
        self._set(*SERVING_THRESHOLDS)

    def backlog(self, waiting: bool) -> None:
        if waiting != self._backlog:
            self._backlog = waiting
            self._set(*(BACKLOG_THRESHOLDS if waiting else SERVING_THRESHOLDS))
