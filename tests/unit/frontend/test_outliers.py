"""Outlier ejection (issue 27): a worker that fails requests of its own fault several times in
a row is out of routing for a backoff, probed with one request, and brought back; never the
last worker of its model. The pure decisions (``outliers.py``), then the worker set's and the
routing choice's part."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import structlog.testing
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import FailureReason
from sidecar_common.kv_keys import block_keys
from sidecar_common.pool import ChannelPool, PoolConfig
from sidecar_common.rpc import StubCache
from sidecar_frontend.outliers import OWN_FAULT, Ejection, Outliers, OutlierSettings, Verdict, own_fault
from sidecar_frontend.registry import Worker, WorkerState, available_first
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.router import Router, RouterConfig, Routing
from sidecar_frontend.workers import WorkerSet

A = "10.0.0.1:1"
SETTINGS = OutlierSettings(consecutive_failures=3, first_ejection=10.0, max_ejection=300.0)

# ------------------------------------------------------------------ which failures count

_R = FailureReason


@pytest.mark.parametrize(
    ("reason", "counts"),
    [
        (_R.INVALID_ARGUMENT, False),
        (_R.CANNOT_CONNECT, True),
        (_R.CONNECTION_TIMEOUT, True),
        (_R.ENGINE_SHUTDOWN, True),
        (_R.CANCELLED, False),
        (_R.OVERLOADED, False),
        (_R.PROTOCOL_ERROR, True),
        (_R.UNKNOWN, True),
        (_R.NO_WORKER, False),
        (_R.DEADLINE, False),
        (_R.NOT_STARTED, False),
        (_R.ENGINE_PAUSED, False),
    ],
)
def test_which_failures_are_the_workers_own_fault(reason: FailureReason, counts: bool) -> None:
    assert own_fault(reason) is counts


def test_every_reason_has_its_row() -> None:
    assert set(OWN_FAULT) == set(FailureReason)


# ------------------------------------------------------------------ the pure decisions


def fail(outliers: Outliers, times: int, now: float = 0.0, address: str = A) -> list[Ejection | None]:
    return [outliers.failed(address, now) for _ in range(times)]


@given(st.integers(1, 12))
def test_ejected_exactly_at_the_nth_failure_in_a_row(needed: int) -> None:
    outliers = Outliers(OutlierSettings(consecutive_failures=needed))
    decisions = fail(outliers, needed, now=100.0)
    assert decisions[:-1] == [None] * (needed - 1)
    assert decisions[-1] == Ejection(until=110.0, failures=needed, strikes=1)


@given(st.lists(st.booleans(), max_size=60), st.integers(1, 6))
def test_ejection_follows_the_failures_in_a_row_and_a_success_starts_over(
    outcomes: list[bool], needed: int
) -> None:
    """A model: ejected at the needed-th failure with no success between; while ejected
    (nobody readmits it here) nothing counts."""
    outliers = Outliers(OutlierSettings(consecutive_failures=needed))
    in_a_row, ejected = 0, False
    for step, succeeded in enumerate(outcomes):
        if succeeded:
            assert outliers.succeeded(A) is Verdict.NONE
            if not ejected:
                in_a_row = 0
            continue
        decision = outliers.failed(A, float(step))
        if ejected:
            assert decision is None
            continue
        in_a_row += 1
        if in_a_row == needed:
            assert decision is not None
            assert decision.failures == needed
            ejected = True
        else:
            assert decision is None


def test_zero_disables_ejection() -> None:
    outliers = Outliers(OutlierSettings(consecutive_failures=0))
    assert fail(outliers, 100) == [None] * 100


def test_workers_are_counted_apart() -> None:
    outliers = Outliers(SETTINGS)
    fail(outliers, 2, address="a")
    fail(outliers, 2, address="b")
    assert outliers.failed("a", 0.0) is not None
    assert outliers.failed("b", 0.0) is not None


def test_a_probe_that_succeeds_restores_the_worker() -> None:
    outliers = Outliers(SETTINGS)
    assert fail(outliers, 3)[-1] is not None
    assert not outliers.probing(A)
    assert outliers.readmitted(A)
    assert outliers.probing(A)
    assert outliers.succeeded(A) is Verdict.RESTORED
    assert not outliers.probing(A)
    assert outliers.succeeded(A) is Verdict.NONE
    # In again: the count starts from zero.
    assert fail(outliers, 2, now=20.0) == [None, None]


def test_a_probe_that_fails_ejects_again_at_once_for_twice_as_long_up_to_the_max() -> None:
    outliers = Outliers(SETTINGS)
    ejection = fail(outliers, 3, now=0.0)[-1]
    assert ejection is not None
    pauses = [ejection.until]
    for _ in range(6):
        now = ejection.until
        assert outliers.readmitted(A)
        ejection = outliers.failed(A, now)
        assert ejection is not None
        assert ejection.failures == 1
        pauses.append(ejection.until - now)
    assert pauses == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]


def test_strikes_are_forgiven_once_the_last_ejection_is_max_ejection_old() -> None:
    outliers = Outliers(SETTINGS)
    first = fail(outliers, 3, now=0.0)[-1]
    assert first == Ejection(until=10.0, failures=3, strikes=1)
    outliers.readmitted(A)
    assert outliers.succeeded(A) is Verdict.RESTORED
    # Failing again soon after: a repeated ejection, twice as long.
    again = fail(outliers, 3, now=100.0)[-1]
    assert again == Ejection(until=120.0, failures=3, strikes=2)
    outliers.readmitted(A)
    outliers.succeeded(A)
    # Failing again max_ejection after that ejection ended: the first pause again.
    later = fail(outliers, 3, now=420.0)[-1]
    assert later == Ejection(until=430.0, failures=3, strikes=1)


def test_outcomes_while_ejected_do_not_count() -> None:
    outliers = Outliers(SETTINGS)
    fail(outliers, 3)
    assert fail(outliers, 10, now=1.0) == [None] * 10
    assert outliers.succeeded(A) is Verdict.NONE, "a call from before the ejection is no probe"
    outliers.readmitted(A)
    assert outliers.probing(A)


def test_a_spared_worker_stays_in_its_count_starts_over_and_its_strike_is_taken_back() -> None:
    outliers = Outliers(SETTINGS)
    assert fail(outliers, 3, now=0.0)[-1] == Ejection(until=10.0, failures=3, strikes=1)
    outliers.spared(A)
    assert not outliers.readmitted(A), "it was never out"
    assert fail(outliers, 3, now=1.0) == [None, None, Ejection(until=11.0, failures=3, strikes=1)]


def test_readmitting_a_worker_it_did_not_eject_is_no_probation() -> None:
    outliers = Outliers(SETTINGS)
    assert not outliers.readmitted(A)
    assert not outliers.probing(A)


def test_a_forgotten_worker_starts_over() -> None:
    outliers = Outliers(SETTINGS)
    fail(outliers, 2)
    outliers.forget(A)
    assert fail(outliers, 2) == [None, None]


@pytest.mark.parametrize(
    "bad",
    [
        {"consecutive_failures": -1},
        {"first_ejection": 0.0},
        {"first_ejection": 20.0, "max_ejection": 10.0},
    ],
)
def test_settings_out_of_range_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must"):
        OutlierSettings(**bad)


def test_the_default_settings_are_the_issues() -> None:
    settings = OutlierSettings()
    assert (settings.consecutive_failures, settings.first_ejection, settings.max_ejection) == (5, 10.0, 300.0)


# ------------------------------------------------------------------ probation in choice


def worker(address: str, *, model: str = "m", role: str = "agg") -> Worker:
    pool = ChannelPool(PoolConfig(parse_endpoint(address)))  # never connected: no I/O here
    stubs = StubCache(pool, lambda channel: sidecar_pb2_grpc.WorkerStub(channel))
    w = Worker(address, role, pool, stubs)  # type: ignore[arg-type]
    w.state = WorkerState.SERVING
    w.model = sidecar_pb2.ModelInfo(served_model_name=model, vocab_size=100, kv_block_size=16)
    return w


async def test_a_worker_on_probation_takes_one_call_at_a_time_unless_it_is_the_only_one() -> None:
    probing, other = worker("10.0.0.1:1"), worker("10.0.0.2:1")
    probing.probation = True
    assert probing.available
    probing.inflight = 1
    assert probing.eligible, "eligible all the same: it is in routing"
    assert not probing.available
    assert available_first([probing, other]) == [other]
    assert available_first([probing]) == [probing]
    other.inflight = 5
    assert other.available, "only probation limits calls"


async def test_the_worker_sets_pick_honours_probation() -> None:
    workers = WorkerSet(rand=random.Random(3))
    probing, other = worker("10.0.0.1:1"), worker("10.0.0.2:1")
    for w in (probing, other):
        workers.registry.add(w)
    probing.probation = True
    probing.inflight = 1  # its probe
    other.inflight = 50  # far busier: picked anyway
    assert {workers.pick(model="m") for _ in range(50)} == {other}
    assert workers.pick(model="m", exclude=frozenset({other.address})) is probing, "the only one left"
    probing.inflight = 0
    assert {workers.pick(model="m") for _ in range(50)} == {probing}


async def test_the_routed_choice_honours_probation() -> None:
    workers = WorkerSet(rand=random.Random(3))
    probing, other = worker("10.0.0.1:1"), worker("10.0.0.2:1")
    for w in (probing, other):
        workers.registry.add(w)
    router = Router(RouterConfig(routing=Routing.ROUND_ROBIN), block_keys, random.Random(0))
    choice = RoutedChoice(workers, router, clock=lambda: 0.0)
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3])
    assert {choice("agg", "m", request, frozenset()) for _ in range(4)} == {probing, other}
    probing.probation = True
    probing.inflight = 1
    assert {choice("agg", "m", request, frozenset()) for _ in range(4)} == {other}
    assert choice("agg", "m", request, frozenset({other.address})) is probing


# ------------------------------------------------------------------ the worker set's part


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def fleet(count: int, clock: Clock, **models: str) -> AsyncIterator[tuple[WorkerSet, list[Worker]]]:
    settings = OutlierSettings(consecutive_failures=3, first_ejection=0.01, max_ejection=0.04)
    async with WorkerSet(clock=clock, outliers=settings, rand=random.Random(1)) as workers:
        members = [worker(f"10.0.0.{n}:1", model=models.get(f"w{n}", "m")) for n in range(count)]
        for w in members:
            workers.registry.add(w)
        yield workers, members


async def until(done: Callable[[], bool], workers: WorkerSet) -> None:
    with anyio.fail_after(30):
        while True:
            changed = workers.next_change()
            if done():
                return
            await changed.wait()


def events(logs: list[dict[str, Any]], address: str) -> list[str]:
    return [e["event"] for e in logs if e.get("worker") == address]


async def test_the_worker_set_ejects_probes_and_restores() -> None:
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        async with fleet(2, clock) as (workers, (bad, good)):
            assert not workers.call_failed(bad, _R.ENGINE_SHUTDOWN)
            assert not workers.call_failed(bad, _R.OVERLOADED), "busy is no fault: no count either way"
            assert not workers.call_failed(bad, _R.CANNOT_CONNECT)
            assert workers.call_failed(bad, _R.UNKNOWN)
            assert not bad.eligible
            assert {workers.pick(model="m") for _ in range(20)} == {good}
            ejected = next(e for e in logs if e["event"] == "worker ejected")
            assert ejected["failures"] == 3
            assert ejected["reason"] == "consecutive failures"
            assert ejected["until"] == pytest.approx(clock.now + 0.01)
            clock.now += 0.01
            await until(lambda: bad.eligible, workers)
            assert bad.probation
            bad.inflight = 1  # the probe
            assert {workers.pick(model="m") for _ in range(20)} == {good}
            bad.inflight = 0
            assert workers.call_succeeded(bad)
            assert not bad.probation
            assert not workers.call_succeeded(bad)
    assert events(logs, bad.address) == [
        "worker ejected",
        "worker back in routing after its ejection",
        "worker restored",
    ]


async def test_a_failed_probe_ejects_again_for_twice_as_long() -> None:
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        async with fleet(2, clock) as (workers, (bad, _)):
            for _ in range(3):
                workers.call_failed(bad, _R.ENGINE_SHUTDOWN)
            clock.now += 0.01
            await until(lambda: bad.eligible, workers)
            assert workers.call_failed(bad, _R.ENGINE_SHUTDOWN), "a failed probe: out at once"
            assert not bad.eligible
            assert not bad.probation
    ejections = [e for e in logs if e["event"] == "worker ejected"]
    assert [(e["failures"], e["strikes"]) for e in ejections] == [(3, 1), (1, 2)]
    assert ejections[0]["until"] == pytest.approx(1000.01)
    assert ejections[1]["until"] == pytest.approx(clock.now + 0.02), "twice the first pause"


async def test_the_last_eligible_worker_of_a_model_is_never_ejected() -> None:
    clock = Clock()
    with structlog.testing.capture_logs() as logs:
        # Two workers, each the only one of its model.
        async with fleet(2, clock, w1="other") as (workers, (alone, _)):
            for _ in range(7):
                assert not workers.call_failed(alone, _R.CANNOT_CONNECT)
            assert alone.eligible
            assert workers.pick(model="m") is alone
    spared = [e for e in logs if e["event"] == "worker not ejected: the last eligible one of its model"]
    assert [e["failures"] for e in spared] == [3, 3], "said once per spared ejection"


async def test_a_draining_worker_is_not_ejected() -> None:
    clock = Clock()
    async with fleet(2, clock) as (workers, (leaving, _)):
        workers.registry.drain(leaving)
        for _ in range(5):
            assert not workers.call_failed(leaving, _R.ENGINE_SHUTDOWN)
        assert leaving.ejected_until is None
