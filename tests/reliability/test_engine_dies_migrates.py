"""A frontend over two workers: a generation whose engine dies inside its running server
(vLLM's engine core, SGLang's scheduler) continues on the other worker, and the client sees the
output of a run with no failure, token for token, for both formats and every engine kind."""

from __future__ import annotations

from typing import Any

import pytest
from testkit.faults import FaultKind, FaultPlan

from tests.integration.frontend.fixtures import FrontendStack, sse_json_events, two_workers
from tests.integration.frontend.test_migration_e2e import MAX_TOKENS, request_body, summary

pytestmark = pytest.mark.timeout(90)

ENGINES = ["vllm", "sglang-grpc", "sglang-http"]


async def events_of(fe: FrontendStack, fmt: str, rid: str) -> list[dict[str, Any]]:
    path, body = request_body(fmt, rid)
    async with fe.http.post(fe.url + path, json=body) as response:
        assert response.status == 200
        return await sse_json_events(response)


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
    async with two_workers(engine, shared_faults=True) as fe:
        reference = await events_of(fe, fmt, "calm")
        fe.sidecars[0].engine.faults.add("-storm", FaultPlan(FaultKind.ENGINE_DIES, after=5), times=1)
        events = await events_of(fe, fmt, "storm")
        assert summary(fmt, events) == summary(fmt, reference)
        assert len(summary(fmt, events)["tokens"]) == MAX_TOKENS
        assert migrations(fe, fmt) == 1
        dead = [s for s in fe.sidecars if getattr(s.engine, "core_dead", False)]
        if engine == "vllm":
            assert len(dead) == 1, "the engine core died inside its running server"
