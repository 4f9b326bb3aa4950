"""The fleet's pauses and weight versions in the worker set (``registry.py``, ``workers.py``,
``placement.py``, ``fleet_watch.py``, ``weight_version_api.py``): a paused worker takes no new
request and is never ejected; a fully paused fleet holds a request and lets it go at continue
(woken by the change, never polled); with --route-latest-weights only workers at the newest
version take new requests and the others are pending."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import structlog.testing
from anyio.abc import TaskStatus
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.errors import FailureReason
from sidecar_common.pool import ChannelPool, PoolConfig
from sidecar_common.rpc import StubCache
from sidecar_frontend.config import WorkerSetConfig
from sidecar_frontend.fleet import EngineState, FleetSettings
from sidecar_frontend.fleet_watch import FleetWatch
from sidecar_frontend.membership import AdminError
from sidecar_frontend.outliers import OutlierSettings
from sidecar_frontend.placement import least_loaded, place
from sidecar_frontend.registry import Worker, WorkerState
from sidecar_frontend.weight_version_api import parse_weight_version
from sidecar_frontend.worker_replies import engine_state, load_problem
from sidecar_frontend.workers import WorkerSet

RUNNING, PAUSED = EngineState.RUNNING, EngineState.PAUSED
REQUEST = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2, 3])


def worker(address: str, *, model: str = "m", role: str = "agg") -> Worker:
    pool = ChannelPool(PoolConfig(parse_endpoint(address)))  # never connected: no I/O here
    stubs = StubCache(pool, lambda channel: sidecar_pb2_grpc.WorkerStub(channel))
    w = Worker(address, role, pool, stubs)  # type: ignore[arg-type]
    w.state = WorkerState.SERVING
    w.model = sidecar_pb2.ModelInfo(served_model_name=model, vocab_size=100, kv_block_size=16)
    return w


@asynccontextmanager
async def fleet(
    count: int, *, latest: bool = False, hold: float = 600.0, failures: int = 1
) -> AsyncIterator[tuple[WorkerSet, list[Worker]]]:
    config = WorkerSetConfig(fleet=FleetSettings(route_latest_weights=latest, paused_hold=hold))
    outliers = OutlierSettings(consecutive_failures=failures, first_ejection=10.0, max_ejection=10.0)
    async with WorkerSet(config, outliers=outliers, rand=random.Random(1)) as workers:
        members = [worker(f"10.0.0.{n}:1") for n in range(count)]
        for w in members:
            workers.registry.add(w)
        yield workers, members


def report(workers: WorkerSet, w: Worker, state: EngineState = RUNNING, version: str | None = None) -> None:
    workers.registry.report_engine(w, state, version)


def picks(workers: WorkerSet) -> set[Worker | None]:
    return {workers.pick(model="m") for _ in range(40)}


# ------------------------------------------------------------------ pauses


async def test_a_paused_worker_takes_no_new_request_while_another_runs() -> None:
    async with fleet(3) as (workers, (a, b, c)):
        for w in (a, b, c):
            report(workers, w)
        report(workers, a, PAUSED)
        assert picks(workers) == {b, c}
        assert a.eligible, "paused is not down"
        assert not a.takes_new
        assert a.listed_state == "paused"
        assert workers.registry.eligible_of("agg", "m") == [a, b, c], "admission still counts its room"
        assert not workers.held("m")
        report(workers, a, RUNNING)
        assert picks(workers) == {a, b, c}


async def test_a_fully_paused_fleet_still_serves_its_model_and_holds_its_requests() -> None:
    async with fleet(2) as (workers, members):
        for w in members:
            report(workers, w, PAUSED)
        assert workers.pick(model="m") is None
        assert workers.routable("m"), "no 503 for a model that is only paused"
        assert "m" in workers.models()
        assert workers.held("m")
        assert "every worker of m is paused (2)" in workers.no_worker_message("m")


async def test_a_paused_worker_is_never_ejected_and_an_engine_paused_refusal_marks_it_paused() -> None:
    async with fleet(2, failures=1) as (workers, (a, b)):
        for w in (a, b):
            report(workers, w)
        assert not workers.call_failed(a, FailureReason.ENGINE_PAUSED)
        assert a.paused, "news of its pause, before its sidecar's report"
        assert a.ejected_until is None
        assert picks(workers) == {b}
        # whatever its calls meet while paused is the pause's doing, not a fault
        for reason in FailureReason:
            assert not workers.call_failed(a, reason)
        assert a.ejected_until is None
        assert a.eligible
        report(workers, a, RUNNING)  # its sidecar's next report has the last word
        assert not a.paused
        assert picks(workers) == {a, b}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(FailureReason)), st.booleans()), max_size=30))
def test_law_a_paused_worker_is_never_ejected(history: list[tuple[FailureReason, bool]]) -> None:
    async def check() -> None:
        async with fleet(2, failures=1) as (workers, (a, b)):
            report(workers, b)
            for reason, paused in history:
                report(workers, a, PAUSED if paused else RUNNING)
                if a.ejected_until is not None:
                    continue  # ejected while running: out of this law's reach
                ejected = workers.call_failed(a, reason)
                if paused or reason is FailureReason.ENGINE_PAUSED:
                    assert not ejected
                    assert a.ejected_until is None

    anyio.run(check)


async def test_a_worker_that_stops_serving_forgets_its_pause_and_version() -> None:
    async with fleet(1) as (workers, (a,)):
        report(workers, a, PAUSED, "v1")
        workers.set_state(a, WorkerState.NOT_SERVING)
        assert a.engine_state is EngineState.UNKNOWN
        assert a.weight_version is None
        assert workers.registry.versions.version_of(a.address) is None


# ------------------------------------------------------------------ holding


async def test_a_held_request_goes_out_at_continue_woken_by_the_change() -> None:
    async with fleet(2) as (workers, (a, b)):
        for w in (a, b):
            report(workers, w, PAUSED)
        placed: list[Any] = []

        async def placing(task_status: TaskStatus[None]) -> None:
            task_status.started()
            placed.append(
                await place(workers, least_loaded(workers), "m", REQUEST, [], patient=True, wait=0.0)
            )

        async with anyio.create_task_group() as group:
            await group.start(placing)
            await anyio.wait_all_tasks_blocked()
            assert placed == [], "held, not answered"
            report(workers, b, RUNNING)
        assert placed == [(b,)]


async def test_the_handler_hold_returns_at_continue_and_at_once_when_not_held() -> None:
    async with fleet(1) as (workers, (a,)):
        report(workers, a, RUNNING)
        assert await workers.hold("m") is None
        report(workers, a, PAUSED)
        outcome: list[str | None] = []

        async def holding(task_status: TaskStatus[None]) -> None:
            task_status.started()
            outcome.append(await workers.hold("m"))

        async with anyio.create_task_group() as group:
            await group.start(holding)
            await anyio.wait_all_tasks_blocked()
            assert outcome == []
            report(workers, a, RUNNING)
        assert outcome == [None]


async def test_past_the_hold_the_request_is_answered_with_the_reason() -> None:
    async with fleet(1, hold=0.05) as (workers, (a,)):
        report(workers, a, PAUSED)
        reason = await workers.hold("m")
        assert reason is not None
        assert "every worker of m is paused" in reason
        assert "--paused-hold-secs" in reason
        assert await place(workers, least_loaded(workers), "m", REQUEST, [], patient=True, wait=0.0) is None


async def test_no_hold_for_a_fleet_that_is_down_rather_than_paused() -> None:
    async with fleet(1) as (workers, (a,)):
        workers.set_state(a, WorkerState.NOT_SERVING)
        assert not workers.held("m")
        assert await workers.hold("m") is None
        assert await place(workers, least_loaded(workers), "m", REQUEST, [], patient=True, wait=0.0) is None


# ------------------------------------------------------------------ weight versions


async def test_with_route_latest_weights_only_the_newest_version_takes_new_requests() -> None:
    async with fleet(3, latest=True) as (workers, (a, b, c)):
        for w in (a, b, c):
            report(workers, w, RUNNING, "v1")
        assert picks(workers) == {a, b, c}
        report(workers, a, RUNNING, "v2")  # a trainer updated a's weights
        assert workers.registry.versions.newest == "v2"
        assert picks(workers) == {a}
        assert [w.listed_state for w in (a, b, c)] == ["serving", "pending", "pending"]
        report(workers, b, RUNNING, "v2")
        assert picks(workers) == {a, b}
        assert c.listed_state == "pending"


async def test_a_recovered_worker_is_pending_until_it_reports_the_current_version() -> None:
    async with fleet(2, latest=True) as (workers, (a, b)):
        for w in (a, b):
            report(workers, w, RUNNING, "v1")
        for w in (a, b):
            report(workers, w, RUNNING, "v2")
        workers.set_state(b, WorkerState.NOT_SERVING)  # its engine restarted
        workers.set_state(b, WorkerState.SERVING)
        assert b.listed_state == "pending", "no version reported yet: it waits"
        report(workers, b, RUNNING, "v1")  # back at its first weights
        assert workers.registry.versions.newest == "v2", "it does not pull the fleet back"
        assert b.listed_state == "pending"
        assert picks(workers) == {a}
        report(workers, b, RUNNING, "v2")
        assert picks(workers) == {a, b}


async def test_no_worker_at_the_newest_version_holds_as_a_paused_fleet() -> None:
    async with fleet(2, latest=True) as (workers, (a, b)):
        for w in (a, b):
            report(workers, w, RUNNING, "v1")
        report(workers, a, RUNNING, "v2")
        workers.set_state(a, WorkerState.NOT_SERVING)
        assert workers.held("m")
        assert "not at the newest weight version 'v2'" in workers.no_worker_message("m")
        report(workers, b, RUNNING, "v2")
        assert not workers.held("m")
        assert picks(workers) == {b}


async def test_without_the_flag_versions_are_shown_but_do_not_route() -> None:
    async with fleet(2) as (workers, (a, b)):
        report(workers, a, RUNNING, "v1")
        report(workers, b, RUNNING, "v1")
        report(workers, a, RUNNING, "v2")
        assert picks(workers) == {a, b}
        assert b.listed_state == "serving"
        workers.set_weight_version("v2")  # an admin call routes by version from now on
        assert picks(workers) == {a}
        assert b.listed_state == "pending"
        workers.set_weight_version(None)
        assert picks(workers) == {a, b}


async def test_mixed_versions_are_visible_in_metrics_and_logs() -> None:
    async with fleet(2) as (workers, (a, b)):
        registry = CollectorRegistry()
        workers.events.subscribe(FleetWatch(registry, workers.registry))
        with structlog.testing.capture_logs() as logs:
            report(workers, a, RUNNING, "v1")
            report(workers, b, RUNNING, "v1")
            report(workers, a, RUNNING, "v2")
            assert registry.get_sample_value("frontend_fleet_weight_versions") == 2
            labels = {"worker": a.address, "version": "v2"}
            assert registry.get_sample_value("frontend_worker_weight_version", labels) == 1
            old = {"worker": a.address, "version": "v1"}
            assert registry.get_sample_value("frontend_worker_weight_version", old) is None
            report(workers, b, RUNNING, "v2")
            report(workers, b, PAUSED, "v2")
            assert registry.get_sample_value("frontend_workers_paused") == 1
        events = [e["event"] for e in logs]
        assert events.count("fleet weight versions mixed") == 1
        assert events.count("fleet weight versions uniform") == 1
        assert events.index("fleet weight versions mixed") < events.index("fleet weight versions uniform")
        assert "worker paused" in events


# ------------------------------------------------------------------ what a sidecar says


def test_a_load_report_gives_the_engine_state_and_version() -> None:
    paused = sidecar_pb2.LoadReport(engine_state=sidecar_pb2.ENGINE_STATE_PAUSED, weight_version="v3")
    assert engine_state(paused) == (EngineState.PAUSED, "v3")
    assert engine_state(sidecar_pb2.LoadReport()) == (EngineState.UNKNOWN, None), "an older sidecar"
    future = sidecar_pb2.LoadReport(engine_state=7)  # type: ignore[arg-type]
    assert engine_state(future) == (EngineState.UNKNOWN, None), "a state a newer sidecar.v1 adds"
    assert load_problem(future) is None
    absurd = sidecar_pb2.LoadReport(weight_version="v" * 2000)
    assert load_problem(absurd) is not None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"weight_version": "v2"}', "v2"),
        (b'{"weight_version": null}', None),
        (b'{"weight_version": ""}', AdminError),
        (b'{"weight_version": 3}', AdminError),
        (b'{"version": "v2"}', AdminError),
        (b"not json", AdminError),
        (b"", AdminError),
    ],
)
def test_post_weight_version_bodies(body: bytes, expected: object) -> None:
    parsed = parse_weight_version(body)
    if expected is AdminError:
        assert isinstance(parsed, AdminError)
        assert parsed.status == 400
    else:
        assert parsed == expected
