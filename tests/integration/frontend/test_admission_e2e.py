"""Admission end to end: a frontend over real testkit vLLM sidecars, small running limits.

Each engine reports its ``max_num_seqs`` through its sidecar; the frontend admits that many
sequences per worker and queues the rest. What a client sees: a refusal is the format's own
error shape with 429 (or 503), ``Retry-After`` and ``x-sidecar-refused-reason``, for a stream
too (never a 200 stream with an error inside); a queued request whose client leaves never
reaches an engine; the more urgent request goes first; a vLLM ``priority`` is honoured by the
queue instead of refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import structlog.testing

from sidecar_frontend.admission.rates import RateConfig, RateLimiter, TenantRate
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FrontendStack, frontend_over, sse_events
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

VLLM_PATH = "/inference/v1/generate"
SGLANG_PATH = "/generate"
PROMPT = [101, 202, 303, 404]
TENANT = "x-gateway-inference-fairness-id"
# One sequence at a time per engine, nothing kept aside: the second request waits.
ONE_AT_A_TIME = AdmissionSettings(max_queue_depth=1, max_queue_wait=60.0, headroom=0.0)


@asynccontextmanager
async def fleet(
    settings: AdmissionSettings = ONE_AT_A_TIME,
    *,
    limiter: RateLimiter | None = None,
    engines: int = 1,
    max_num_seqs: int = 1,
) -> AsyncIterator[FrontendStack]:
    async with AsyncExitStack() as stack:
        sidecars = [
            await stack.enter_async_context(vllm_stack(max_num_seqs=max_num_seqs, token_latency_ms=20.0))
            for _ in range(engines)
        ]
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        yield await stack.enter_async_context(
            frontend_over(
                addresses,
                sidecars,
                formats=(SGLANG, VLLM),
                config=HandlerConfig(worker_wait=3600.0),
                admission=AdmissionConfig(settings=settings),
                limiter=limiter,
            )
        )


def vllm_body(
    rid: str, max_tokens: int, *, stream: bool = False, priority: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": rid,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }
    if priority is not None:
        body["priority"] = priority
    return body


def sglang_body(rid: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }


class Holder:
    """A long streaming request that holds a running slot until the test lets it go."""

    def __init__(self, fe: FrontendStack, rid: str, tenant: str = "") -> None:
        self.fe, self.rid, self.tenant = fe, rid, tenant
        self.first = anyio.Event()

    async def run(self) -> None:
        headers = {TENANT: self.tenant} if self.tenant else {}
        async with self.fe.http.post(
            self.fe.url + VLLM_PATH, json=vllm_body(self.rid, 2000, stream=True), headers=headers
        ) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: "):
                    self.first.set()


def queued(fe: FrontendStack) -> int:
    assert fe.gate is not None
    return sum(sum(by.values()) for by in fe.gate.queued().values())


def engine_saw(fe: FrontendStack, rid: str) -> bool:
    return any(got.endswith(rid) for sidecar in fe.sidecars for got, _ in sidecar.engine.book.received)


async def post(
    fe: FrontendStack, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    with anyio.fail_after(60):
        async with fe.http.post(fe.url + path, json=body, headers=headers or {}) as response:
            raw = await response.read()
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw.decode()
            return response.status, dict(response.headers), data


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [VLLM_PATH, SGLANG_PATH], ids=["vllm", "sglang"])
async def test_a_full_queue_is_a_429_in_the_formats_shape_with_retry_after(path: str, stream: bool) -> None:
    async with fleet() as fe, anyio.create_task_group() as group:
        holder = Holder(fe, "hold")
        group.start_soon(holder.run)
        with anyio.fail_after(30):
            await holder.first.wait()
        # The second request waits (the band holds one: the most --max-queue-depth allows)...
        group.start_soon(post, fe, VLLM_PATH, vllm_body("waits", 1))
        await until(lambda: queued(fe) == 1, "the second request queued")
        # ...so the third is refused at once, before any engine work.
        body = (
            vllm_body("third", 1, stream=stream)
            if path == VLLM_PATH
            else sglang_body("third", 1, stream=stream)
        )
        status, headers, data = await post(fe, path, body)
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-sidecar-refused-reason"] == "queue_full"
        assert headers["Content-Type"].startswith("application/json")
        if path == VLLM_PATH:
            assert set(data) == {"error"}
            error = data["error"]
            assert (error["type"], error["code"], error["param"]) == ("Too Many Requests", 429, None)
            message = error["message"]
        else:
            assert {k: data[k] for k in ("object", "type", "code", "param")} == {
                "object": "error",
                "type": "429",
                "code": 429,
                "param": None,
            }
            message = data["message"]
        assert "queue_full" in message
        assert not engine_saw(fe, "third")
        group.cancel_scope.cancel()


async def test_a_request_that_waits_too_long_is_a_429_queue_timeout() -> None:
    settings = AdmissionSettings(max_queue_depth=8, max_queue_wait=0.5, headroom=0.0)
    async with fleet(settings) as fe, anyio.create_task_group() as group:
        holder = Holder(fe, "hold")
        group.start_soon(holder.run)
        with anyio.fail_after(30):
            await holder.first.wait()
        status, headers, data = await post(fe, VLLM_PATH, vllm_body("late", 1, stream=True))
        assert status == 429
        assert headers["x-sidecar-refused-reason"] == "queue_timeout"
        assert int(headers["Retry-After"]) >= 1
        assert "queue_timeout" in data["error"]["message"]
        assert not engine_saw(fe, "late")
        assert queued(fe) == 0
        group.cancel_scope.cancel()


async def test_a_tenant_over_its_rate_gets_429_rate_limited_and_another_tenant_is_served() -> None:
    config = RateConfig(default=TenantRate(), tenants={"greedy": TenantRate(requests_per_minute=1)})
    limiter = RateLimiter(config)
    async with fleet(AdmissionSettings(headroom=0.0), limiter=limiter, max_num_seqs=4) as fe:
        status, _, _ = await post(fe, VLLM_PATH, vllm_body("g1", 1), {TENANT: "greedy"})
        assert status == 200
        status, headers, data = await post(fe, SGLANG_PATH, sglang_body("g2", 1), {TENANT: "greedy"})
        assert status == 429
        assert headers["x-sidecar-refused-reason"] == "rate_limited"
        assert int(headers["Retry-After"]) >= 1
        assert data["code"] == 429
        assert not engine_saw(fe, "g2")
        status, _, _ = await post(fe, VLLM_PATH, vllm_body("other", 1), {TENANT: "modest"})
        assert status == 200


async def test_a_queued_client_that_leaves_never_reaches_an_engine() -> None:
    settings = AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0)
    async with fleet(settings) as fe:
        async with anyio.create_task_group() as holding:
            holder = Holder(fe, "hold")
            holding.start_soon(holder.run)
            with anyio.fail_after(30):
                await holder.first.wait()
            async with anyio.create_task_group() as leaving:
                leaving.start_soon(post, fe, VLLM_PATH, vllm_body("leaves", 1, stream=True))
                await until(lambda: queued(fe) == 1, "the request queued")
                leaving.cancel_scope.cancel()  # the client closes its connection
            await until(lambda: queued(fe) == 0, "the request left the queue")
            holding.cancel_scope.cancel()  # the running slot frees
        # The slot is free again and the next request runs; the one that left never ran.
        status, _, _ = await post(fe, VLLM_PATH, vllm_body("next", 1))
        assert status == 200
        assert engine_saw(fe, "next")
        assert not engine_saw(fe, "leaves")
        cancelled = fe.metrics.registry.get_sample_value(
            "frontend_admission_decisions_total",
            {
                "model": fe.workers.default_model() or "",
                "tenant": "",
                "outcome": "cancelled",
                "reason": "CLIENT_GONE",
            },
        )
        assert cancelled == 1
        # The request is counted as any whose client left (as is the holder, whose client left too).
        left = fe.metrics.registry.get_sample_value(
            "frontend_requests_total", {"format": "vllm", "outcome": "disconnected", "reason": "CLIENT_GONE"}
        )
        assert left == 2


async def test_the_more_urgent_request_is_admitted_first() -> None:
    settings = AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0)
    async with fleet(settings) as fe:
        finished: list[str] = []

        async def send(rid: str, priority: int) -> None:
            status, _, _ = await post(fe, VLLM_PATH, vllm_body(rid, 2, priority=priority))
            assert status == 200
            finished.append(rid)

        async with anyio.create_task_group() as senders, anyio.create_task_group() as holding:
            holder = Holder(fe, "hold")
            holding.start_soon(holder.run)
            with anyio.fail_after(30):
                await holder.first.wait()
            # vLLM's meaning: the lower value first. The less urgent one arrives first.
            senders.start_soon(send, "later", 5)
            await until(lambda: queued(fe) == 1, "the less urgent request queued")
            senders.start_soon(send, "sooner", -5)
            await until(lambda: queued(fe) == 2, "the more urgent request queued")
            holding.cancel_scope.cancel()  # the holder leaves: one slot, two waiting
        assert finished == ["sooner", "later"]


async def test_a_vllm_priority_is_served_by_the_queue_not_refused() -> None:
    # vLLM's gRPC wire carries no priority (its sidecar refuses one other than 0): with admission
    # the frontend honours it in its queue and the engine runs the request at its default.
    async with fleet(AdmissionSettings(), max_num_seqs=4) as fe:
        status, _, data = await post(fe, VLLM_PATH, vllm_body("urgent", 2, priority=-3))
        assert status == 200, data
        assert engine_saw(fe, "urgent")


async def test_a_bad_priority_header_is_a_400_naming_it() -> None:
    async with fleet(AdmissionSettings(), max_num_seqs=4) as fe:
        status, _, data = await post(fe, VLLM_PATH, vllm_body("bad", 1), {"x-sidecar-priority": "soon"})
        assert status == 400
        assert "x-sidecar-priority" in data["error"]["message"]


async def test_a_streaming_request_that_waited_is_served_once_admitted() -> None:
    settings = AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0)
    async with fleet(settings) as fe:
        result: list[tuple[int, list[str]]] = []

        async def waiter() -> None:
            with anyio.fail_after(60):
                async with fe.http.post(
                    fe.url + VLLM_PATH, json=vllm_body("waiter", 3, stream=True)
                ) as response:
                    result.append((response.status, await sse_events(response)))

        async with anyio.create_task_group() as waiting, anyio.create_task_group() as holding:
            holder = Holder(fe, "hold")
            holding.start_soon(holder.run)
            with anyio.fail_after(30):
                await holder.first.wait()
            waiting.start_soon(waiter)
            await until(lambda: queued(fe) == 1, "the stream queued")
            holding.cancel_scope.cancel()
        [(status, events)] = result
        assert status == 200
        assert events[-1] == "[DONE]"
        tokens = [t for event in events[:-1] for t in json.loads(event)["choices"][0]["token_ids"]]
        assert len(tokens) == 3
        # Its wait is counted for its tenant (the default one here).
        model = fe.workers.default_model() or ""
        waited = fe.metrics.registry.get_sample_value(
            "frontend_admission_tenant_wait_seconds_total", {"model": model, "tenant": ""}
        )
        assert waited is not None
        assert waited > 0


async def test_a_flood_that_fills_the_queue_makes_room_for_another_tenant() -> None:
    settings = AdmissionSettings(max_queue_depth=2, max_queue_wait=60.0, headroom=0.0)
    async with fleet(settings) as fe:
        answers: dict[str, int] = {}
        reasons: dict[str, str] = {}

        async def send(rid: str, tenant: str) -> None:
            status, headers, _ = await post(fe, VLLM_PATH, vllm_body(rid, 1), {TENANT: tenant})
            reasons[rid] = headers.get("x-sidecar-refused-reason", "")
            answers[rid] = status

        async with anyio.create_task_group() as senders, anyio.create_task_group() as holding:
            holder = Holder(fe, "hold", tenant="flood")
            holding.start_soon(holder.run)
            with anyio.fail_after(30):
                await holder.first.wait()
            senders.start_soon(send, "flood-0", "flood")
            await until(lambda: queued(fe) == 1, "the flood's first request queued")
            senders.start_soon(send, "flood-1", "flood")
            await until(lambda: queued(fe) == 2, "the flood's second request queued")
            # The band is full; the quiet tenant's request takes the flood's newest place.
            senders.start_soon(send, "quiet", "quiet")
            await until(lambda: "flood-1" in answers, "the flood's newest request answered")
            assert answers["flood-1"] == 429
            assert reasons["flood-1"] == "queue_pushed_out"
            holding.cancel_scope.cancel()
        assert answers == {"flood-0": 200, "flood-1": 429, "quiet": 200}
        assert not engine_saw(fe, "flood-1")


async def test_the_request_line_names_its_tenant_urgency_and_time_in_the_queue() -> None:
    # A slow first token is told apart as queueing or serving from the line alone.
    async with fleet() as fe:
        answers: list[int] = []
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as group:
                holder = Holder(fe, "hold", tenant="batch")
                holding = anyio.CancelScope()

                async def hold() -> None:
                    with holding:
                        await holder.run()

                async def wait_for_the_slot() -> None:
                    headers = {TENANT: "chat"}
                    status, _, _ = await post(fe, VLLM_PATH, vllm_body("waits", 1, priority=-2), headers)
                    answers.append(status)

                group.start_soon(hold)
                with anyio.fail_after(30):
                    await holder.first.wait()
                group.start_soon(wait_for_the_slot)
                await until(lambda: queued(fe) == 1, "the second request queued")
                await anyio.sleep(0.2)  # so it waited at least this long when the slot frees
                holding.cancel()  # the holder's client leaves: its slot frees
        assert answers == [200]
        lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
        held = lines["generate-tokens-hold"]
        assert (held["tenant"], held["urgency"], held["queued_ms"]) == ("batch", 0, 0.0)
        waited = lines["generate-tokens-waits"]
        # vLLM's priority -2 is served before 0: urgency 2.
        assert (waited["tenant"], waited["urgency"]) == ("chat", 2)
        assert waited["queued_ms"] >= 200.0
        # Why it waited, at debug: the one slot held, nobody else's, no reserve (headroom 0).
        (why,) = [e for e in logs if e["event"] == "request queued"]
        assert {k: why[k] for k in ("tenant", "urgency", "total_slots", "foreign_slots", "held_slots")} == {
            "tenant": "chat",
            "urgency": 2,
            "total_slots": 1,
            "foreign_slots": 0,
            "held_slots": 1,
        }
        assert why["reserve"] == 0
        assert why["stale_workers"] in (0, 1)  # this fixture's one worker may not have reported yet


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_request_no_worker_has_room_for_is_a_503_no_capacity_at_once(stream: bool) -> None:
    # One engine of one running slot: an SGLang request of two sequences can never run here.
    # It is refused at once with 503 (nothing to wait for), in the format's shape, before any
    # engine. (vLLM's format refuses such an `n` itself first, 400, as vLLM does: `n` at most
    # the server's max_num_seqs.)
    async with fleet() as fe:
        body = sglang_body("two", 1, stream=stream)
        body["sampling_params"]["n"] = 2
        status, headers, data = await post(fe, SGLANG_PATH, body)
        assert status == 503
        assert headers["Retry-After"] == "1"
        assert headers["x-sidecar-refused-reason"] == "no_capacity"
        assert headers["Content-Type"].startswith("application/json")
        assert {k: data[k] for k in ("object", "type", "code", "param")} == {
            "object": "error",
            "type": "503",
            "code": 503,
            "param": None,
        }
        assert "no_capacity" in data["message"]
        assert "2 sequences" in data["message"]
        assert not engine_saw(fe, "two")
