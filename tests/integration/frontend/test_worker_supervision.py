"""The frontend's long-lived machinery is supervised (issue 26): one worker's fault never
makes the frontend die or go deaf.

- After a TLS rotation the KV stream moves to the new connections as the health Watch does;
  once the old connections are closed (a short retire grace) the worker still polls its load
  and still hears its sidecar restart. (Before: grpc.aio's bare CancelledError out of the old
  stream ended the worker's every task silently, and it stayed SERVING, polled by no one.)
- A per-worker task that raises, or ends in a bare CancelledError, is one error line naming
  its task and worker, counted, and run again; every request in flight and every other worker
  go on.
- A hostile worker's health, model, load and KV replies (undecodable, absurd, hung, a gap after
  every snapshot) are refused at the edge: the worker is named in the log, counted and taken
  out of routing for a while; every request succeeds on the honest workers.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
import structlog.testing
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2
from sidecar_common.tls import ClientTlsFiles
from sidecar_frontend import workers as workers_module
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.misbehaviour import Misbehaviour
from sidecar_frontend.registry import Worker, WorkerState
from sidecar_frontend.routing.router import RouterConfig
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import WorkerSet
from tests.hostile_worker import Kind, hostile_worker
from tests.integration.frontend.fixtures import FAST_STREAMS, FAST_WORKERS, FrontendStack, frontend_over
from tests.pki import Ca, make_ca, make_leaf
from tests.vllm_fixtures import vllm_stack

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(15)]

WAIT = 30.0


async def until(done: Callable[[], bool], events: Any, what: str) -> None:
    """Until ``done()``, woken by each change of the worker set (bounded)."""
    with anyio.fail_after(WAIT):
        while True:
            changed = events.next_change()
            if done():
                return
            await changed.wait()
    raise AssertionError(what)


def failures(logs: list[Any], task: str | None = None) -> list[Any]:
    return [e for e in logs if e["event"] == "background task failed" and (task is None or e["task"] == task)]


# ---------------------------------------------------------------------------- TLS rotation


def write(path: Path, data: bytes) -> None:
    temporary = path.with_suffix(path.suffix + ".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def client_files(where: Path, ca: Ca) -> ClientTlsFiles:
    leaf = make_leaf("frontend", ca, server=False)
    write(where / "ca.pem", ca[0].cert)
    write(where / "tls.key", leaf.key)
    write(where / "tls.crt", leaf.cert)
    return ClientTlsFiles(where / "ca.pem", where / "tls.crt", where / "tls.key")


async def test_after_a_tls_rotation_the_kv_stream_moves_and_the_worker_keeps_polling_and_hears_a_restart(
    tmp_path: Path,
) -> None:
    ca = make_ca("fleet CA")
    server = make_leaf("sidecar", ca, server=True)
    credentials = grpc.ssl_server_credentials(
        [(server.key, server.cert)], root_certificates=ca[0].cert, require_client_auth=True
    )
    files = client_files(tmp_path, ca)
    config = replace(FAST_WORKERS, tls=files, tls_check_interval=0.05, retire_grace=0.2)
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(config) as workers:
            parts = RoutingParts.build(RouterConfig(), CollectorRegistry(), streams=FAST_STREAMS)
            parts.choice(workers)
            async with hostile_worker(credentials=credentials) as sidecar:
                workers.add_worker(sidecar.address)
                with anyio.fail_after(WAIT):
                    await workers.wait_serving()
                await sidecar.wait_calls("WatchKvCache", 1)

                client_files(tmp_path, ca)  # rotated in place: a new client certificate
                # The stream is watched again on the new connections, resuming where it was.
                await sidecar.wait_calls("WatchKvCache", 2)
                with anyio.fail_after(WAIT):
                    # The old connections are closed after the grace.
                    await workers.supervisor.until_ended(f"retire {sidecar.address}")

                polled = sidecar.calls["GetLoad"]
                await sidecar.wait_calls("GetLoad", polled + 3)
                worker = workers.get(sidecar.address)
                assert worker is not None
                assert worker.state is WorkerState.SERVING
                port = sidecar.address.rsplit(":", 1)[1]

            # Its sidecar restarts on the same port: the worker hears it go, then come back.
            await until(lambda: worker.state is WorkerState.NOT_SERVING, workers.events, "heard it stop")
            async with hostile_worker(listen=f"127.0.0.1:{port}", credentials=credentials) as again:
                await until(lambda: worker.state is WorkerState.SERVING, workers.events, "heard it return")
                await again.wait_calls("WatchKvCache", 1)  # and its stream follows the new sidecar
    assert not failures(logs), failures(logs)


# ---------------------------------------------------------------------------- a task that fails


class Companion:
    """A per-worker task started at each join (as routing starts a worker's KV stream), which
    fails once on ``target`` when ``fire`` is set: with ``error`` raised."""

    def __init__(self, workers: WorkerSet, target: str, error: BaseException) -> None:
        self.workers = workers
        self.target = target
        self.error = error
        self.fire = anyio.Event()
        self.runs: dict[str, int] = {}
        self.ran = anyio.Event()

    def joined(self, worker: Worker) -> None:
        self.workers.supervisor.start("companion", lambda: self._run(worker.address), owner=worker.address)

    def changed(self, worker: Worker) -> None:
        pass

    def left(self, worker: Worker) -> None:
        pass

    async def _run(self, address: str) -> None:
        self.runs[address] = self.runs.get(address, 0) + 1
        ran, self.ran = self.ran, anyio.Event()
        ran.set()
        if address == self.target and self.runs[address] == 1:
            await self.fire.wait()
            raise self.error
        await anyio.sleep_forever()

    async def wait_runs(self, address: str, count: int) -> None:
        with anyio.fail_after(WAIT):
            while self.runs.get(address, 0) < count:
                await self.ran.wait()


async def stream_tokens(fe: FrontendStack, rid: str, tokens: int, first: Callable[[], None]) -> list[int]:
    """A streamed request's tokens; ``first()`` is called once its first token came."""
    body = {
        "token_ids": [1, 2, 3],
        "request_id": rid,
        "stream": True,
        "sampling_params": {"max_tokens": tokens},
    }
    got: list[int] = []
    async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().strip()
            if text.startswith("data: {"):
                event = json.loads(text[len("data: ") :])
                assert "error" not in event, event
                for choice in event["choices"]:
                    got.extend(choice.get("token_ids") or ())
                if got and len(got) == len(choice.get("token_ids") or ()):
                    first()
    return got


REQUESTS = 16


@pytest.mark.parametrize(
    "error", [RuntimeError("a bug in a companion"), asyncio.CancelledError()], ids=["raises", "bare-cancel"]
)
async def test_a_worker_task_that_fails_is_logged_with_its_worker_and_restarted_while_requests_go_on(
    error: BaseException,
) -> None:
    async with vllm_stack(token_latency_ms=10) as one, vllm_stack(token_latency_ms=10) as two:
        addresses = [f"127.0.0.1:{one.server.port}", f"127.0.0.1:{two.server.port}"]
        with structlog.testing.capture_logs() as logs:
            async with frontend_over(addresses, [one, two], formats=(VLLM,)) as fe:
                companion = Companion(fe.workers, addresses[0], error)
                fe.workers.events.subscribe(companion)
                for worker in fe.workers.workers():
                    companion.joined(worker)
                await companion.wait_runs(addresses[0], 1)
                answers: list[list[int]] = []
                streaming = 0
                all_streaming = anyio.Event()

                def started() -> None:
                    nonlocal streaming
                    streaming += 1
                    if streaming == REQUESTS:
                        all_streaming.set()

                async def ask(n: int) -> None:
                    answers.append(await stream_tokens(fe, f"r{n}", 40, started))

                async with anyio.create_task_group() as group:
                    for n in range(REQUESTS):
                        group.start_soon(ask, n)
                    with anyio.fail_after(WAIT):
                        await all_streaming.wait()
                    companion.fire.set()  # fails while every request streams
                    await companion.wait_runs(addresses[0], 2)  # and runs again
                assert len(answers) == REQUESTS
                assert all(len(a) == 40 for a in answers), "every request in flight completed"
                assert companion.runs[addresses[1]] == 1, "the other worker's task was untouched"
                assert all(w.state is WorkerState.SERVING for w in fe.workers.workers())
    failed = failures(logs, "companion")
    assert len(failed) == 1, failed
    assert failed[0]["worker"] == addresses[0]
    assert failed[0]["log_level"] == "error"


# ---------------------------------------------------------------------------- a hostile worker


async def generate(fe: FrontendStack, rid: str, tokens: int = 4) -> list[int]:
    body = {"token_ids": [5, 6, 7], "request_id": rid, "sampling_params": {"max_tokens": tokens}}
    with anyio.fail_after(WAIT):
        async with fe.http.post(fe.url + "/inference/v1/generate", json=body) as response:
            data = await response.json()
    assert response.status == 200, data
    return [t for choice in data["choices"] for t in choice["token_ids"]]


@pytest.mark.parametrize(
    ("kind", "reported"),
    [
        (Kind.HEALTH_GARBAGE, Misbehaviour.UNDECODABLE_HEALTH),
        (Kind.MODEL_INFO_GARBAGE, Misbehaviour.UNDECODABLE_MODEL_INFO),
        (Kind.LOAD_GARBAGE, Misbehaviour.UNDECODABLE_LOAD),
        (Kind.LOAD_NEGATIVE, Misbehaviour.ABSURD_LOAD),
        (Kind.LOAD_NAN, Misbehaviour.ABSURD_LOAD),
        (Kind.LOAD_HUGE, Misbehaviour.ABSURD_LOAD),
        (Kind.LOAD_HANG, Misbehaviour.HUNG_LOAD),
        (Kind.KV_GARBAGE, Misbehaviour.UNDECODABLE_KV),
        (Kind.KV_HUGE_ZERO_BLOCK, Misbehaviour.ABSURD_KV),
        (Kind.KV_HUGE_MAX_BLOCK, Misbehaviour.ABSURD_KV),
        (Kind.KV_GAP, Misbehaviour.KV_RESYNC_STORM),
    ],
    ids=lambda value: value.value if isinstance(value, Kind) else "",
)
async def test_a_hostile_workers_replies_cost_that_worker_and_nothing_else(
    kind: Kind, reported: Misbehaviour, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: each undecodable reply kind raised AttributeError out of its task and took the
    frontend down; absurd loads and KV snapshots were believed; a hung GetLoad was logged at
    debug; a gap after every snapshot was a reconnect loop."""
    # Out of routing for the whole test, however slowly a loaded machine runs its requests
    # (the readmission after an ejection is its own test's).
    monkeypatch.setattr(workers_module, "EJECTION_FIRST_SECS", 3600.0)
    async with vllm_stack() as one, vllm_stack() as two:
        info: sidecar_pb2.ModelInfo = await one.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest())
        with structlog.testing.capture_logs() as logs:
            async with hostile_worker(info, kinds=[kind], huge_keys=70_000) as hostile:
                addresses = [f"127.0.0.1:{one.server.port}", f"127.0.0.1:{two.server.port}", hostile.address]
                async with frontend_over(
                    addresses, [one, two], formats=(VLLM,), serving=2, routing=RouterConfig()
                ) as fe:
                    worker = fe.workers.get(hostile.address)
                    assert worker is not None
                    await until(lambda: worker.ejected_until is not None, fe.workers.events, "ejected")
                    assert not worker.eligible
                    for n in range(12):
                        assert len(await generate(fe, f"{kind.value}-{n}")) == 4
                    assert hostile.calls["Generate"] == 0, "no request went to the ejected worker"
                    assert {w.address for w in fe.workers.serving()} == set(addresses[:2])
    said = [e for e in logs if e["event"] == "worker misbehaved" and e["worker"] == hostile.address]
    assert [e["kind"] for e in said][:1] == [reported.value], said
    assert not failures(logs), failures(logs)


@pytest.mark.parametrize(("bound", "ejected"), [(2, True), (3, False)])
async def test_a_snapshot_past_the_configured_key_bound_is_misbehaviour(bound: int, ejected: bool) -> None:
    """The worker's snapshot holds 3 keys: over a bound of 2 it is refused, at 3 it is indexed."""
    streams = replace(FAST_STREAMS, max_snapshot_keys=bound)
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(FAST_WORKERS) as workers, hostile_worker() as sidecar:
            parts = RoutingParts.build(RouterConfig(), CollectorRegistry(), streams=streams)
            parts.choice(workers)
            workers.add_worker(sidecar.address)
            worker = workers.get(sidecar.address)
            assert worker is not None
            assert parts.streams is not None
            cache = parts.streams
            if ejected:
                await until(lambda: worker.ejected_until is not None, workers.events, "ejected")
            else:
                with anyio.fail_after(WAIT):
                    while not cache.publishes(sidecar.address):
                        await sidecar.wait_calls("GetLoad", sidecar.calls["GetLoad"] + 1)
                assert worker.ejected_until is None
    said = [e["kind"] for e in logs if e["event"] == "worker misbehaved"]
    assert said == (["absurd_kv"] if ejected else [])


async def test_a_models_index_goes_when_its_last_worker_leaves_with_no_scrape() -> None:
    """Routing follows the set's events: the index of a model rolled out of the fleet is
    dropped when its last worker is forgotten (it used to wait for a metrics scrape)."""
    async with WorkerSet(FAST_WORKERS) as workers, hostile_worker() as sidecar:
        parts = RoutingParts.build(RouterConfig(), CollectorRegistry(), streams=FAST_STREAMS)
        parts.choice(workers)
        assert parts.router is not None
        assert parts.streams is not None
        router, cache = parts.router, parts.streams
        workers.add_worker(sidecar.address)
        with anyio.fail_after(WAIT):
            while not cache.publishes(sidecar.address):
                await sidecar.wait_calls("GetLoad", sidecar.calls["GetLoad"] + 1)
        assert list(router.indexes()) == [sidecar.model_info.served_model_name]
        workers.drain_worker(sidecar.address)
        await until(lambda: sidecar.address not in workers.addresses(), workers.events, "forgotten")
        assert dict(router.indexes()) == {}


async def test_a_misbehaving_worker_is_out_of_routing_for_a_while_then_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers_module, "EJECTION_FIRST_SECS", 0.2)
    with structlog.testing.capture_logs() as logs:
        async with WorkerSet(FAST_WORKERS) as workers, hostile_worker() as sidecar:
            workers.add_worker(sidecar.address)
            with anyio.fail_after(WAIT):
                await workers.wait_serving()
            worker = workers.get(sidecar.address)
            assert worker is not None
            workers.misbehaviour.report(sidecar.address, Misbehaviour.OUT_OF_VOCAB, "token 40000 of 32000")
            assert not worker.eligible
            assert workers.pick() is None, "the only worker is out of routing"
            await until(lambda: worker.eligible, workers.events, "back in routing")
            assert workers.pick() is worker
    said = [e["event"] for e in logs if e.get("worker") == sidecar.address]
    assert "worker out of routing: it misbehaved" in said
    assert "worker back in routing after its ejection" in said
