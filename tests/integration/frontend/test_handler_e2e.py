"""The handler end to end over real sidecars: a probe format (plugin.py) -> Frontend ->
WorkerSet -> SidecarServer -> testkit vLLM engine, all on loopback in one process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
import structlog.testing
from prometheus_client import generate_latest
from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import SamplingSpec, generate

from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import WorkerFailure
from sidecar_frontend.handler import HandlerConfig
from sidecar_frontend.metrics import Metrics
from sidecar_frontend.server import WorkerMetrics, start_metrics_endpoint
from sidecar_frontend.workers import WorkerSet, WorkerState
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FAST_WORKERS, FrontendStack, frontend_stack, sse_events
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

PROMPT = [101, 202, 303, 404]


def expected(fe: FrontendStack, count: int, prompt: list[int] = PROMPT) -> list[int]:
    model = fe.sidecars[0].engine.config.model
    return [t.token_id for t in generate(model, prompt, SamplingSpec(max_tokens=count), 0)][:count]


async def post(fe: FrontendStack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with fe.http.post(fe.url + path, json=body) as response:
        return response.status, await response.json()


def aborts_for(fe: FrontendStack, rid: str, index: int = 0) -> list[str]:
    return [p for p in fe.sidecars[index].engine.book.aborts if p.endswith("-" + rid)]


async def settled(fe: FrontendStack) -> None:
    """Until every exchange and every sidecar generation ended (a sidecar's engine abort
    completes before its generation does, so the engines' books are final then)."""
    await until(lambda: fe.frontend.inflight == 0, "the exchanges ended")
    await until(lambda: all(s.server.inflight == 0 for s in fe.sidecars), "the sidecars are idle")


def metric(fe: FrontendStack, name: str, **labels: str) -> float:
    value = fe.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# ---------------------------------------------------------------------------- delivery


async def test_unary_generation_returns_the_engines_tokens() -> None:
    async with frontend_stack() as fe:
        status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 5, "rid": "u1"})
        assert status == 200
        assert body == {"outputs": [{"ids": expected(fe, 5), "finish": "LENGTH", "error": None}]}
        assert metric(fe, "frontend_requests_total", format="test", outcome="ok", reason="NONE") == 1
        assert metric(fe, "frontend_completion_tokens_total", format="test") == 5
        assert metric(fe, "frontend_prompt_tokens_total", format="test") == 4


async def test_streaming_writes_one_event_per_output_then_the_close_bytes() -> None:
    async with frontend_stack() as fe:
        body = {"ids": PROMPT, "max": 4, "rid": "s1", "stream": True}
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            assert response.headers["Transfer-Encoding"] == "chunked"
            events = await sse_events(response)
        assert events[-1] == "[DONE]"
        outputs = [json.loads(e) for e in events[:-1]]
        assert [t for o in outputs for t in o["ids"]] == expected(fe, 4)
        assert outputs[-1]["finish"] == "LENGTH"
        assert all(o["finish"] is None for o in outputs[:-1])


async def test_sub_requests_run_concurrently_and_each_reaches_its_index() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 20.0}]) as fe:
        status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "subs": 3})
        assert status == 200
        assert [o["ids"] for o in body["outputs"]] == [expected(fe, 3)] * 3
        # Three generations were in flight at once on the engine (each holds 60 ms).
        assert len(fe.sidecars[0].engine.book.received) == 3


# ---------------------------------------------------------------------------- cancellation


async def test_client_disconnect_cancels_the_call_and_the_engine_aborts_exactly_once() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 50.0}]) as fe:
        body = {"ids": PROMPT, "max": 200, "rid": "gone", "stream": True}
        response = await fe.http.post(fe.url + "/t/generate", json=body)
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        response.close()  # the client goes away mid-stream
        await settled(fe)
        assert len(aborts_for(fe, "gone")) == 1
        assert (
            metric(fe, "frontend_requests_total", format="test", outcome="disconnected", reason="CLIENT_GONE")
            == 1
        )


async def test_client_disconnect_before_the_first_token_also_aborts_once() -> None:
    async with frontend_stack() as fe:
        fe.sidecars[0].engine.faults.add("stall", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=30))
        body = {"ids": PROMPT, "max": 4, "rid": "stall", "stream": True}
        response = await fe.http.post(fe.url + "/t/generate", json=body)
        book = fe.sidecars[0].engine.book
        await until(lambda: len(book.running_ids()) == 1, "the engine runs it")
        response.close()
        await settled(fe)
        assert len(aborts_for(fe, "stall")) == 1


async def test_request_timeout_reports_deadline_and_aborts_the_engine_request() -> None:
    async with frontend_stack(config=HandlerConfig(request_timeout=0.5)) as fe:
        fe.sidecars[0].engine.faults.add("slow", FaultPlan(FaultKind.HANG, after=2))
        body = {"ids": PROMPT, "max": 50, "rid": "slow", "stream": True}
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            events = await sse_events(response)
        outputs = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]"
        assert outputs[-1]["error"] == "DEADLINE"
        assert [t for o in outputs for t in o.get("ids", [])] == expected(fe, 2)
        await settled(fe)
        assert len(aborts_for(fe, "slow")) == 1
        assert metric(fe, "frontend_requests_total", format="test", outcome="timeout", reason="DEADLINE") == 1


async def test_abort_by_id_reaches_every_client_using_that_id_and_only_them() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 40.0}]) as fe:
        book = fe.sidecars[0].engine.book
        same = {"ids": PROMPT, "max": 200, "rid": "twin", "stream": True}
        other = {"ids": PROMPT, "max": 8, "rid": "other"}

        async def stream() -> list[Any]:
            async with fe.http.post(fe.url + "/t/generate", json=same) as response:
                return [json.loads(e) for e in (await sse_events(response))[:-1]]

        async with anyio.create_task_group() as group:
            results: list[list[Any]] = []

            async def run_one() -> None:
                results.append(await stream())

            group.start_soon(run_one)
            group.start_soon(run_one)
            bystander = asyncio.ensure_future(post(fe, "/t/generate", other))
            await until(lambda: len(book.running_ids()) == 3, "three generations run")
            status, body = await post(fe, "/t/abort", {"rid": "twin"})
            assert (status, body) == (200, {"aborted": 2})
        for events in results:
            assert events[-1]["error"] == "CANCELLED"
        status, body = await bystander
        await settled(fe)
        # Each client had its own private id at the sidecar; each was aborted once.
        assert len(aborts_for(fe, "twin")) == 2
        assert len(set(aborts_for(fe, "twin"))) == 2
        assert body["outputs"][0]["finish"] == "LENGTH"
        assert aborts_for(fe, "other") == []


async def test_stop_all_ends_in_flight_requests_with_the_given_failure() -> None:
    # What the process does once its drain timeout ran out.
    async with frontend_stack(engines=[{"token_latency_ms": 40.0}]) as fe:
        body = {"ids": PROMPT, "max": 300, "rid": "late", "stream": True}
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            fe.frontend.stop_all(
                WorkerFailure(FailureReason.ENGINE_SHUTDOWN, "the frontend is shutting down")
            )
            events = await sse_events(response)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"] == "ENGINE_SHUTDOWN"
        await settled(fe)
        assert len(aborts_for(fe, "late")) == 1
        assert (
            metric(fe, "frontend_requests_total", format="test", outcome="shutdown", reason="ENGINE_SHUTDOWN")
            == 1
        )


async def test_abort_of_an_unknown_id_aborts_nothing() -> None:
    async with frontend_stack() as fe:
        assert await post(fe, "/t/abort", {"rid": "nobody"}) == (200, {"aborted": 0})


# ---------------------------------------------------------------------------- failures and retry


async def test_failure_before_the_first_token_is_retried_once_on_another_worker() -> None:
    async with frontend_stack(2) as fe:
        # Worker 0's engine refuses every request before any token; worker 1 is healthy.
        fe.sidecars[0].engine.faults.add("r", FaultPlan(FaultKind.FAIL_OPEN))
        for n in range(6):
            status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": f"r{n}"})
            assert status == 200
            assert body["outputs"][0] == {"ids": expected(fe, 3), "finish": "LENGTH", "error": None}
        tried_first = len(fe.sidecars[0].engine.book.received)
        assert tried_first > 0, "the seeded choice sends some requests to worker 0 first"
        assert metric(fe, "frontend_retries_total", format="test") == tried_first


async def test_with_migration_off_a_failure_after_the_first_token_is_reported() -> None:
    async with frontend_stack(2, config=HandlerConfig(migration_limit=0)) as fe:
        for sidecar in fe.sidecars:
            sidecar.engine.faults.add("late", FaultPlan(FaultKind.CLOSE_AFTER, after=2))
        async with fe.http.post(
            fe.url + "/t/generate", json={"ids": PROMPT, "max": 9, "rid": "late", "stream": True}
        ) as response:
            events = [json.loads(e) for e in (await sse_events(response))[:-1]]
        assert [t for e in events for t in e.get("ids", [])] == expected(fe, 2)
        assert events[-1]["error"] == "ENGINE_SHUTDOWN"
        assert metric(fe, "frontend_retries_total", format="test") == 0
        received = sum(len(s.engine.book.received) for s in fe.sidecars)
        assert received == 1


async def test_a_worker_error_that_is_not_retryable_is_reported_at_once() -> None:
    async with frontend_stack(2) as fe:
        for sidecar in fe.sidecars:
            sidecar.engine.faults.add(
                "bad", FaultPlan(FaultKind.ERROR_AFTER, after=0, code="INVALID_ARGUMENT")
            )
        _status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": "bad"})
        assert body["outputs"][0]["error"] == "INVALID_ARGUMENT"
        assert sum(len(s.engine.book.received) for s in fe.sidecars) == 1


# A worker_wait no test outlives: a request that waited for a worker would fail the test.
NEVER = HandlerConfig(worker_wait=3600.0)


async def test_a_busy_answer_with_no_other_worker_reaches_the_client_at_once() -> None:
    # The engine refuses for capacity (gRPC RESOURCE_EXHAUSTED: the sidecar's OVERLOADED); the
    # one worker is still serving, so no other can be waited for: answered now, not after the
    # handler's worker_wait.
    async with frontend_stack(config=NEVER) as fe:
        busy = FaultPlan(FaultKind.ERROR_AFTER, after=0, code="RESOURCE_EXHAUSTED")
        fe.sidecars[0].engine.faults.add("busy", busy)
        with anyio.fail_after(30):
            status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": "busy"})
        assert status == 200
        assert body["outputs"][0]["error"] == "OVERLOADED"
        assert len(fe.sidecars[0].engine.book.received) == 1
        assert metric(fe, "frontend_retries_total", format="test") == 0


async def test_a_busy_answer_is_retried_on_another_worker_once_each() -> None:
    async with frontend_stack(2, config=NEVER) as fe:
        busy = FaultPlan(FaultKind.ERROR_AFTER, after=0, code="RESOURCE_EXHAUSTED")
        fe.sidecars[0].engine.faults.add("one", busy)
        for sidecar in fe.sidecars:
            sidecar.engine.faults.add("both", busy)
        with anyio.fail_after(30):
            # Whichever worker is picked first, worker 1 serves it.
            for n in range(4):
                status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": f"one{n}"})
                assert body["outputs"][0] == {"ids": expected(fe, 3), "finish": "LENGTH", "error": None}
            # Both busy: each asked once, then the busy answer (never the first one again).
            status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": "both"})
        assert status == 200
        assert body["outputs"][0]["error"] == "OVERLOADED"
        asked = [[rid for rid, _ in s.engine.book.received if rid.endswith("-both")] for s in fe.sidecars]
        assert [len(ids) for ids in asked] == [1, 1]


async def test_an_encoder_that_aborts_on_a_failure_stops_the_other_sub_requests() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 30.0}]) as fe:
        fe.sidecars[0].engine.faults.add("fat", FaultPlan(FaultKind.ERROR_AFTER, after=0), times=1)
        body = {"ids": PROMPT, "max": 300, "rid": "fat", "subs": 2, "fatal": True}
        status, reply = await post(fe, "/t/generate", body)
        assert status == 200
        errors = [o["error"] for o in reply["outputs"]]
        assert sorted(errors, key=str) == [None, "UNKNOWN"], "one failed; the other was stopped, unreported"
        await settled(fe)
        # The failed one and the survivor (cancelled after 300 tokens' worth of time was not spent).
        assert len(aborts_for(fe, "fat")) == 2
        ended = [r for r in fe.sidecars[0].engine.book.finished if r.request_id.endswith("-fat")]
        assert len(ended) == 2
        assert Outcome.FINISHED not in {r.outcome for r in ended}


# ---------------------------------------------------------------------------- workers


async def test_a_not_serving_worker_is_never_picked() -> None:
    async with frontend_stack(2) as fe:
        await fe.sidecars[1].server.drain()  # health NOT_SERVING from now on
        worker = fe.workers.get(fe.address(1))
        assert worker is not None
        await until(lambda: worker.state is WorkerState.NOT_SERVING, "the watch saw NOT_SERVING")
        for n in range(8):
            status, _ = await post(fe, "/t/generate", {"ids": PROMPT, "max": 2, "rid": f"ns{n}"})
            assert status == 200
        assert len(fe.sidecars[0].engine.book.received) == 8
        # A draining sidecar refuses before its engine (and the refusal would be retried), so
        # what shows a pick of it is a retry.
        assert metric(fe, "frontend_retries_total", format="test") == 0


async def test_no_serving_worker_is_a_503_in_the_formats_shape() -> None:
    async with frontend_stack() as fe:
        await fe.sidecars[0].server.drain()
        worker = fe.workers.get(fe.address(0))
        assert worker is not None
        await until(lambda: worker.state is WorkerState.NOT_SERVING, "the watch saw NOT_SERVING")
        status, body = await post(fe, "/t/generate", {"ids": PROMPT, "max": 2})
        assert (status, body["status"]) == (503, 503)
        async with fe.http.get(fe.url + "/health") as response:
            assert response.status == 503
        assert fe.sidecars[0].engine.book.received == []


async def test_a_killed_worker_mid_run_fails_over_for_new_requests() -> None:
    async with frontend_stack(2, engines=[{"token_latency_ms": 30.0}, {"token_latency_ms": 30.0}]) as fe:
        body = {"ids": PROMPT, "max": 100, "stream": True}
        streams = [
            await fe.http.post(fe.url + "/t/generate", json={**body, "rid": f"k{n}"}) for n in range(4)
        ]
        firsts = []
        for response in streams:
            line = (await response.content.readline()).decode()
            assert line.startswith("data: ")
            firsts.append(json.loads(line[len("data: ") :]))
        victim = fe.sidecars[0]
        await victim.server.stop()  # the worker dies under its in-flight streams
        results = []
        for first, response in zip(firsts, streams, strict=True):
            events = [first, *(json.loads(e) for e in (await sse_events(response))[:-1])]
            response.close()
            results.append(events)
        # Streams on the dead worker had delivered tokens: they continue on the survivor, and
        # every client sees one whole generation.
        on_victim = len(victim.engine.book.received)
        assert on_victim > 0, "the seeded choice sends some streams to the victim"
        for events in results:
            assert events[-1].get("finish") == "LENGTH"
            assert [t for e in events for t in e.get("ids", [])] == expected(fe, 100)
        assert metric(fe, "frontend_migrations_total", format="test", outcome="migrated") == on_victim
        # New requests go to the survivor only.
        for n in range(4):
            _status, reply = await post(fe, "/t/generate", {"ids": PROMPT, "max": 2, "rid": f"after{n}"})
            assert reply["outputs"][0]["finish"] == "LENGTH"
        assert len(victim.engine.book.received) == on_victim


async def test_requests_waiting_for_their_first_token_on_a_killed_worker_are_retried_elsewhere() -> None:
    async with frontend_stack(2) as fe:
        victim, survivor = fe.sidecars
        victim.engine.faults.add("pre", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=30))

        async def one(n: int) -> Any:
            return await post(fe, "/t/generate", {"ids": PROMPT, "max": 3, "rid": f"pre{n}"})

        tasks = [asyncio.ensure_future(one(n)) for n in range(6)]
        books = (victim.engine.book, survivor.engine.book)
        await until(lambda: sum(len(b.received) for b in books) == 6, "all six reached a worker")
        on_victim = len(victim.engine.book.received)
        assert on_victim > 0, "the seeded choice sends some to the victim"
        await victim.server.stop()  # killed while they wait for their first token
        for status, body in await asyncio.gather(*tasks):
            assert status == 200
            assert body["outputs"][0] == {"ids": expected(fe, 3), "finish": "LENGTH", "error": None}
        assert metric(fe, "frontend_retries_total", format="test") == on_victim
        assert len(survivor.engine.book.received) == 6


async def test_drain_worker_lets_in_flight_finish_then_forgets_it() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 20.0}]) as fe:
        address = fe.address(0)
        body = {"ids": PROMPT, "max": 10, "rid": "d", "stream": True}
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            fe.workers.drain_worker(address)
            assert fe.workers.pick() is None
            events = [json.loads(e) for e in (await sse_events(response))[:-1]]
        assert events[-1]["finish"] == "LENGTH"
        await until(lambda: address not in fe.workers.addresses(), "the drained worker is forgotten")
        fe.workers.add_worker(address)  # and may come back
        with anyio.fail_after(10):
            await fe.workers.wait_serving()


async def test_add_worker_is_idempotent_and_addresses_lists_the_workers() -> None:
    async with frontend_stack() as fe:
        fe.workers.add_worker(fe.address(0))
        assert fe.workers.addresses() == frozenset({fe.address(0)})
        with pytest.raises(ValueError, match="role"):
            fe.workers.add_worker("127.0.0.1:1", role="both")


# ---------------------------------------------------------------------------- HTTP details


async def test_a_body_over_the_limit_is_refused_in_the_formats_shape() -> None:
    async with frontend_stack(config=HandlerConfig(max_body_bytes=1024)) as fe:
        status, body = await post(fe, "/t/generate", {"ids": list(range(1, 600))})
        assert (status, body["status"]) == (413, 413)
        assert fe.sidecars[0].engine.book.received == []


async def test_a_method_no_format_declared_is_405_in_the_formats_shape() -> None:
    async with frontend_stack() as fe, fe.http.get(fe.url + "/t/generate") as response:
        assert response.status == 405
        assert (await response.json())["status"] == 405


async def test_a_refusal_by_the_format_reaches_no_worker() -> None:
    async with frontend_stack() as fe:
        status, body = await post(fe, "/t/generate", {"ids": []})
        assert (status, body["error"]) == (400, "ids: required")
        assert fe.sidecars[0].engine.book.received == []
        assert (
            metric(fe, "frontend_requests_total", format="test", outcome="invalid", reason="INVALID_REQUEST")
            == 1
        )


async def test_info_routes_answer_from_the_workers_model() -> None:
    async with frontend_stack() as fe:
        async with fe.http.get(fe.url + "/t/model") as response:
            assert await response.json() == {"model": "testkit-model"}
        async with fe.http.get(fe.url + "/health") as response:
            assert response.status == 200
            assert "Content-Type" not in response.headers
            assert await response.read() == b""


async def test_worker_inflight_gauge_follows_the_generations() -> None:
    async with frontend_stack(engines=[{"token_latency_ms": 30.0}]) as fe:
        body = {"ids": PROMPT, "max": 50, "rid": "g", "stream": True}
        async with fe.http.post(fe.url + "/t/generate", json=body) as response:
            await response.content.readline()
            assert metric(fe, "frontend_worker_inflight", worker=fe.address(0)) == 1
        await until(lambda: fe.frontend.inflight == 0, "the exchange ended")
        assert metric(fe, "frontend_worker_inflight", worker=fe.address(0)) == 0


async def test_the_request_line_of_a_refused_request_says_why_and_carries_its_id() -> None:
    async with frontend_stack() as fe:
        with structlog.testing.capture_logs() as logs:
            status, _ = await post(fe, "/t/generate", {"ids": [], "rid": "bad-1"})
        assert status == 400
        lines = [e for e in logs if e["event"] == "request"]
        assert len(lines) == 1
        line = lines[0]
        assert (line["request_id"], line["outcome"], line["reason"], line["status"]) == (
            "bad-1",
            "invalid",
            "INVALID_REQUEST",
            400,
        )
        assert line["error"] == "ids: required"


async def test_a_worker_that_left_the_set_is_gone_from_the_metrics_endpoint() -> None:
    # The series the handler writes for a worker it used (in flight, call durations, time to
    # first output) leave /metrics when the worker leaves the set: a fleet whose pods come and
    # go does not grow the scrape without bound.
    metrics = Metrics()
    async with (
        frontend_stack(2, listener=WorkerMetrics(metrics), metrics=metrics) as fe,
        scrape_endpoint(metrics) as scrape,
    ):
        gone, staying = fe.address(0), fe.address(1)
        body = {"ids": PROMPT, "max": 2}

        async def used_both() -> bool:
            text = await scrape()
            return all(f'worker="{address}"' in text for address in (gone, staying))

        with anyio.fail_after(60):
            # Until the handler has used both workers (each is drawn at random).
            while not await used_both():
                status, _ = await post(fe, "/t/generate", body)
                assert status == 200
        changed = fe.workers.next_change()
        fe.workers.drain_worker(gone)
        with anyio.fail_after(20):
            while gone in fe.workers.addresses():
                await changed.wait()
                changed = fe.workers.next_change()
        text = await scrape()
        assert gone not in text
        assert f'frontend_worker_inflight{{worker="{staying}"}}' in text


@asynccontextmanager
async def scrape_endpoint(metrics: Metrics) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """The frontend's /metrics endpoint on a free port, and a function that scrapes it."""
    runner = await start_metrics_endpoint(metrics, "127.0.0.1", 0)
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

            async def scrape() -> str:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                    assert response.status == 200
                    return await response.text()

            yield scrape
    finally:
        await runner.cleanup()


async def test_a_drained_workers_series_leave_the_scrape_with_it() -> None:
    async with vllm_stack() as first, vllm_stack() as second:
        metrics = Metrics()
        addresses = [f"127.0.0.1:{first.server.port}", f"127.0.0.1:{second.server.port}"]
        async with WorkerSet(FAST_WORKERS) as workers:
            workers.events.subscribe(WorkerMetrics(metrics))
            for address in addresses:
                workers.add_worker(address)
            with anyio.fail_after(20):
                await workers.wait_serving(2)
            for address in addresses:
                metrics.set_worker_inflight(address, 0)
                metrics.worker_call(address, 0.1)
                metrics.worker_failed(address, "OVERLOADED")
            changed = workers.next_change()
            workers.drain_worker(addresses[0])
            while addresses[0] in workers.addresses():
                await changed.wait()
                changed = workers.next_change()
        scrape = generate_latest(metrics.registry).decode()
        assert addresses[0] not in scrape
        assert addresses[1] in scrape
