"""Calls a sidecar's gRPC server never started (issue 29), end to end over a real sidecar.

gRPC's server core keeps calls the application has not yet picked up in a pending queue and
refuses calls past its limits with a bare RESOURCE_EXHAUSTED (no sidecar ErrorInfo, no start
marker). Here the sidecar's limits are tiny (``ServerConfig.pending_calls``), so a burst of
requests overflows them as a burst of thousands overflows the defaults. Such a call reached no
engine: the frontend runs it again (the same worker, after a pause) and the client never sees
it. And with the frontend's start slots (``--max-starting-calls-per-worker``) below the limits,
the queue never overflows at all.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.handler import HandlerConfig
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

PATH = "/inference/v1/generate"
BURST = 80
# Past 3 calls waiting, the sidecar's server refuses every new one.
TINY_PENDING = (3, 3)


@asynccontextmanager
async def one_worker(start_slots: int) -> AsyncIterator[FrontendStack]:
    async with vllm_stack(pending_calls=TINY_PENDING) as sidecar:
        address = f"127.0.0.1:{sidecar.server.port}"
        config = HandlerConfig(start_slots=start_slots, worker_wait=3600.0)
        async with frontend_over([address], [sidecar], formats=(VLLM,), config=config) as fe:
            yield fe


async def burst(fe: FrontendStack) -> list[tuple[int, Any]]:
    results: list[tuple[int, Any]] = []

    async def one(rid: str) -> None:
        body = {"request_id": rid, "token_ids": [11, 12, 13], "sampling_params": {"max_tokens": 4}}
        async with fe.http.post(fe.url + PATH, json=body) as response:
            results.append((response.status, json.loads(await response.read())))

    with anyio.fail_after(90):
        async with anyio.create_task_group() as group:
            for index in range(BURST):
                group.start_soon(one, f"r{index}")
    return results


def not_started(fe: FrontendStack) -> float:
    value = fe.metrics.registry.get_sample_value(
        "frontend_worker_failures_total", {"worker": fe.address(0), "reason": "NOT_STARTED"}
    )
    return value or 0.0


async def test_calls_the_sidecars_server_refused_are_run_again_and_every_client_is_served() -> None:
    async with one_worker(start_slots=10_000) as fe:
        worker = fe.workers.get(fe.address(0))
        assert worker is not None
        assert worker.failures_typed  # its ModelInfo says so
        results = await burst(fe)
        assert [status for status, _ in results] == [200] * BURST
        assert all(len(body["choices"][0]["token_ids"]) == 4 for _, body in results)
        # The server did refuse calls (else this test shows nothing), and none reached a client.
        assert not_started(fe) > 0
        # Each request reached the engine once: a refused call never got there.
        received = fe.sidecars[0].engine.book.received
        assert len(received) == BURST


async def test_with_start_slots_below_the_servers_limits_no_call_is_refused() -> None:
    async with one_worker(start_slots=1) as fe:
        results = await burst(fe)
        assert [status for status, _ in results] == [200] * BURST
        assert not_started(fe) == 0
