"""A frontend over two workers: a generation whose engine dies inside its running server
(vLLM's engine core, SGLang's scheduler) continues on the other worker, and the client sees the
output of a run with no failure, token for token, for both formats and every engine kind."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from testkit.faults import FaultBook, FaultKind, FaultPlan
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.integration.frontend.test_migration_e2e import MAX_TOKENS, request_body, summary
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(90)

ENGINES = ["vllm", "sglang-grpc", "sglang-http"]


@asynccontextmanager
async def two_workers(engine: str) -> AsyncIterator[FrontendStack]:
    async with AsyncExitStack() as stack:
        sidecars: list[Any] = []
        for _ in range(2):
            if engine == "vllm":
                cm: Any = vllm_stack(token_latency_ms=15.0)
            else:
                cm = sglang_stack(engine.removeprefix("sglang-"), token_latency_ms=15.0)  # type: ignore[arg-type]
            sidecars.append(await stack.enter_async_context(cm))
        # One book for both engines: the fault fires once, on whichever runs the request first,
        # and the continuation on the other one runs clean.
        shared = FaultBook()
        for sidecar in sidecars:
            sidecar.engine.faults = shared
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        async with frontend_over(addresses, sidecars, formats=(SGLANG, VLLM)) as fe:
            yield fe


async def events_of(fe: FrontendStack, fmt: str, rid: str) -> list[dict[str, Any]]:
    path, body = request_body(fmt, rid)
    events: list[dict[str, Any]] = []
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200
        async for line in response.content:
            text = line.decode().rstrip("\r\n")
            if text.startswith("data: ") and text != "data: [DONE]":
                events.append(json.loads(text[len("data: ") :]))
    return events


def migrations(fe: FrontendStack, fmt: str) -> float:
    value = fe.metrics.registry.get_sample_value(
        "frontend_migrations_total", {"format": fmt, "outcome": "migrated"}
    )
    return 0.0 if value is None else value


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_generation_whose_engine_dies_inside_its_server_completes_elsewhere_unchanged(
    engine: str, fmt: str
) -> None:
    async with two_workers(engine) as fe:
        reference = await events_of(fe, fmt, "calm")
        fe.sidecars[0].engine.faults.add("-storm", FaultPlan(FaultKind.ENGINE_DIES, after=5), times=1)
        events = await events_of(fe, fmt, "storm")
        assert summary(fmt, events) == summary(fmt, reference)
        assert len(summary(fmt, events)["tokens"]) == MAX_TOKENS
        assert migrations(fe, fmt) == 1
        dead = [s for s in fe.sidecars if getattr(s.engine, "core_dead", False)]
        if engine == "vllm":
            assert len(dead) == 1, "the engine core died inside its running server"
