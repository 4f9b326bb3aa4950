"""Load listeners of the worker events: told each believed report, in order; one that raises is
logged and the others are still told; unsubscribed, it is told nothing more; a report is not a
change (the change waiters are not woken by it)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog.testing

from sidecar_frontend.worker_events import WorkerEvents


@dataclass(frozen=True)
class Addressed:
    address: str


def test_load_listeners_are_told_in_order_and_one_fault_keeps_no_news_from_the_others() -> None:
    events: WorkerEvents[Addressed] = WorkerEvents()
    told: list[tuple[str, str]] = []
    change = events.next_change()

    def broken(worker: Addressed) -> None:
        raise RuntimeError("listener fault")

    events.subscribe_load(lambda w: told.append(("first", w.address)))
    events.subscribe_load(broken)
    unsubscribe = events.subscribe_load(lambda w: told.append(("last", w.address)))
    with structlog.testing.capture_logs() as logs:
        events.loaded(Addressed("w:1"))
    assert told == [("first", "w:1"), ("last", "w:1")]
    (fault,) = [e for e in logs if e["event"] == "worker load listener failed"]
    assert fault["worker"] == "w:1"
    assert not change.is_set()
    unsubscribe()
    unsubscribe()  # twice is harmless
    events.loaded(Addressed("w:2"))
    assert told[-1] == ("first", "w:2")
    assert len(told) == 3
