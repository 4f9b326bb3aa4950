"""The frontend follows each worker's load as its sidecar pushes it (WatchLoad, issue 27): the
worker's figures change as the engine's do, with no poll; a sidecar older than WatchLoad is
polled with GetLoad until it restarts; a pushed report that cannot be believed is misbehaviour
as a polled one is; a silent stream leaves the worker's figures to age, which is no
misbehaviour; after a TLS rotation the stream moves to the new connections."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
import structlog.testing

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_frontend import agent as agent_module
from sidecar_frontend import workers as workers_module
from sidecar_frontend.misbehaviour import Misbehaviour
from sidecar_frontend.registry import Worker, WorkerState
from sidecar_frontend.workers import WorkerSet
from tests.e2e_helpers import public_request
from tests.hostile_worker import HostileWorker, Kind, hostile_worker
from tests.integration.frontend.fixtures import FAST_WORKERS
from tests.integration.frontend.test_worker_supervision import client_files
from tests.pki import make_ca, make_leaf

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(10)]

WAIT = 30.0


async def until(done: Callable[[], bool], what: str) -> None:
    """Until ``done()`` (bounded): the worker's figures change with no event to wait on."""
    with anyio.fail_after(WAIT):
        while not done():  # noqa: ASYNC110 - polling fields, no event to wait on
            await anyio.sleep(0.01)
    assert done(), what


async def a_later_report(worker: Worker, what: str) -> None:
    """Until the frontend believes a report after the last one it had."""
    before = worker.load_reported_at
    await until(lambda: worker.load_reported_at != before, what)


def misbehaved(logs: list[Any], address: str) -> list[str]:
    return [e["kind"] for e in logs if e["event"] == "worker misbehaved" and e["worker"] == address]


async def serving_worker(workers: WorkerSet, sidecar: HostileWorker) -> Worker:
    workers.add_worker(sidecar.address)
    with anyio.fail_after(WAIT):
        await workers.wait_serving()
    worker = workers.get(sidecar.address)
    assert worker is not None
    return worker


async def test_pushed_reports_set_the_workers_figures_as_the_engines_change_with_no_poll() -> None:
    async with (
        WorkerSet(FAST_WORKERS) as workers,
        hostile_worker(watch_load=True, kinds=[Kind.FINAL_THEN_OPEN]) as sidecar,
    ):
        # Admission's load listener: told each believed report, the figures already set.
        told: list[tuple[str, int | None]] = []
        workers.events.subscribe_load(lambda w: told.append((w.address, w.running_requests)))
        worker = await serving_worker(workers, sidecar)
        await until(lambda: worker.load_reported_at is not None, "a first report")
        assert (worker.running_requests, worker.waiting_requests, worker.kv_usage) == (0, 0, 0.1)
        assert worker.reported_inflight == 0
        assert worker.publishes_cache
        first_at = worker.load_reported_at

        # A generation that stays open on the worker (not through the frontend: another
        # frontend's, as far as this one knows).
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            call = sidecar_pb2_grpc.WorkerStub(channel).Generate(public_request("elsewhere"))
            try:
                await until(lambda: worker.running_requests == 1, "the generation's report")
                assert worker.reported_inflight == 1
                assert worker.own_at_report == 0
                assert worker.load_reported_at is not None
                assert first_at is not None
                assert worker.load_reported_at > first_at
            finally:
                call.cancel()
            await until(lambda: worker.running_requests == 0, "the report after it ended")
        assert told[0] == (sidecar.address, 0)
        assert (sidecar.address, 1) in told
        assert told[-1] == (sidecar.address, 0)
        assert sidecar.calls["GetLoad"] == 0, "pushed, never polled"
        assert sidecar.calls["WatchLoad"] == 1, "one stream all along"


async def test_an_older_sidecar_is_polled_then_watched_once_it_restarts_with_watch_load() -> None:
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(FAST_WORKERS) as workers:
            async with hostile_worker() as older:
                worker = await serving_worker(workers, older)
                await older.wait_calls("GetLoad", 3)
                assert worker.load_reported_at is not None
                assert (worker.running_requests, worker.waiting_requests, worker.kv_usage) == (0, 0, 0.1)
                # Asked when the worker was added and (at most) once more when its ModelInfo
                # came: never again while the same sidecar answers.
                await older.wait_calls("GetLoad", older.calls["GetLoad"] + 3)
                assert 1 <= older.calls["WatchLoad"] <= 2
                assert older.calls["WatchLoad/report"] == 0
                port = older.address.rsplit(":", 1)[1]
            await until(lambda: worker.state is WorkerState.NOT_SERVING, "heard it stop")
            async with hostile_worker(listen=f"127.0.0.1:{port}", watch_load=True) as upgraded:
                await until(lambda: worker.state is WorkerState.SERVING, "heard it return")
                await upgraded.wait_calls("WatchLoad/report", 1)
                polled = upgraded.calls["GetLoad"]
                for _ in range(2):
                    await a_later_report(worker, "a pushed report")
                assert upgraded.calls["GetLoad"] == polled, "no longer polled"
    fell_back = [e for e in logs if e["event"] == "worker load polled: its sidecar serves no WatchLoad"]
    assert 1 <= len(fell_back) <= 2
    assert not misbehaved(logs, older.address)


@pytest.mark.parametrize(
    ("kind", "reported"),
    [
        (Kind.LOAD_GARBAGE, Misbehaviour.UNDECODABLE_LOAD),
        (Kind.LOAD_NEGATIVE, Misbehaviour.ABSURD_LOAD),
        (Kind.LOAD_NAN, Misbehaviour.ABSURD_LOAD),
        (Kind.LOAD_HUGE, Misbehaviour.ABSURD_LOAD),
    ],
    ids=lambda value: value.value if isinstance(value, Kind) else "",
)
async def test_a_pushed_report_that_cannot_be_believed_is_misbehaviour(
    kind: Kind, reported: Misbehaviour, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers_module, "EJECTION_FIRST_SECS", 3600.0)
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(FAST_WORKERS) as workers, hostile_worker(watch_load=True, after=1) as sidecar:
            told: list[float | None] = []
            workers.events.subscribe_load(lambda w: told.append(w.load_reported_at))
            worker = await serving_worker(workers, sidecar)
            await until(lambda: worker.load_reported_at is not None, "the first (honest) report")
            believed = (worker.reported_inflight, worker.load_reported_at)
            heard = len(told)
            sidecar.misbehave(kind)
            await until(lambda: worker.ejected_until is not None, "ejected")
            # The report was not believed: the figures are the honest one's, and no load
            # listener was told of it.
            assert (worker.reported_inflight, worker.load_reported_at) == believed
            assert len(told) == heard
            assert told[-1] == believed[1]
            assert sidecar.calls["GetLoad"] == 0
    assert misbehaved(logs, sidecar.address)[:1] == [reported.value]


async def test_a_silent_stream_leaves_the_figures_to_age_and_is_no_misbehaviour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Silent after 3 heartbeats of 0.2 s (the real heartbeat is a second).
    monkeypatch.setattr(agent_module, "LOAD_HEARTBEAT_SECS", 0.2)
    with structlog.testing.capture_logs() as logs:
        async with (
            WorkerSet(FAST_WORKERS) as workers,
            hostile_worker(watch_load=True, kinds=[Kind.LOAD_HANG], after=1) as sidecar,
        ):
            worker = await serving_worker(workers, sidecar)
            await until(lambda: worker.load_reported_at is not None, "the first (honest) report")
            last_report = worker.load_reported_at
            # Watched again after the silence, and silent again.
            await sidecar.wait_calls("WatchLoad", 3)
            assert worker.load_reported_at == last_report, "nothing new was believed"
            assert worker.state is WorkerState.SERVING
            assert worker.ejected_until is None
            assert worker.eligible
            sidecar.behave()
            await until(lambda: worker.load_reported_at != last_report, "reports again")
    assert not misbehaved(logs, sidecar.address)
    events = [e["event"] for e in logs if e.get("worker") == sidecar.address]
    stopped = "worker load reports stopped: its load is stale until they resume"
    # Warned at once, then at a doubling interval from 2 s (FAST_WORKERS): once here.
    assert events.count(stopped) == 1
    assert events.index(stopped) < events.index("worker load reports resumed")


async def test_after_a_tls_rotation_the_load_stream_moves_to_the_new_connections(tmp_path: Path) -> None:
    ca = make_ca("fleet CA")
    server = make_leaf("sidecar", ca, server=True)
    credentials = grpc.ssl_server_credentials(
        [(server.key, server.cert)], root_certificates=ca[0].cert, require_client_auth=True
    )
    files = client_files(tmp_path, ca)
    config = replace(FAST_WORKERS, tls=files, tls_check_interval=0.05, retire_grace=0.2)
    with structlog.testing.capture_logs() as logs:
        async with (
            WorkerSet(config) as workers,
            hostile_worker(credentials=credentials, watch_load=True) as sidecar,
        ):
            worker = await serving_worker(workers, sidecar)
            await sidecar.wait_calls("WatchLoad/report", 1)
            client_files(tmp_path, ca)  # rotated in place: a new client certificate
            await sidecar.wait_calls("WatchLoad", 2)
            with anyio.fail_after(WAIT):
                # The old connections are closed after the grace.
                await workers.supervisor.until_ended(f"retire {sidecar.address}")
            # Reports keep coming on the new connections (the heartbeat's).
            for _ in range(3):
                await a_later_report(worker, "a report on the new connections")
            assert sidecar.calls["GetLoad"] == 0
    assert not [e for e in logs if e["event"] == "background task failed"]
