"""Under CPU starvation nothing that would succeed fails.

A fixture saturates every core with a busy-looping process at the sidecar's own priority (as
other work on a shared machine would), then the engine-death, soak (at a reduced scale) and
fleet scenarios run, and every fault-free request must succeed: a busy engine answers its
health probes late, which is not death (docs/common.md, "Engine health")."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from sidecar_common.server import ServerConfig
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from testkit.faults import FaultBook, FaultKind, FaultPlan
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.integration.frontend.test_migration_e2e import MAX_TOKENS, request_body, summary
from tests.reliability.harness import KINDS, Kind, expected_tokens, outcomes, rig, until
from tests.reliability.test_engine_death import WATCH, death_and_return
from tests.reliability.test_soak import Tally, check_one, decide, make_plans, run_batch
from tests.vllm_fixtures import vllm_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SOAK_REQUESTS = 300  # per engine kind: a tenth of the soak's default scale


@pytest.fixture
def cpu_hog() -> Iterator[list[subprocess.Popen[bytes]]]:
    """One busy loop per core, at the default priority, killed (by pid) at the end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(timeout=30)


def assert_hogging(hogs: list[subprocess.Popen[bytes]]) -> None:
    assert all(hog.poll() is None for hog in hogs), "a CPU hog stopped before the scenario ended"


@pytest.mark.parametrize("kind", KINDS)
async def test_engine_death_and_return_under_a_cpu_hog(
    kind: Kind, cpu_hog: list[subprocess.Popen[bytes]]
) -> None:
    config = ServerConfig(listen="127.0.0.1:0", health_watch_interval=WATCH, health_probe_timeout=1.0)
    async with rig(kind, server=config, token_latency_ms=20) as r:
        # Streams end migratable, then every request after the engine's return succeeds.
        await death_and_return(r.stub, r.health, r.server, r.model, r.kill_engine, r.restart_engine)
        await until(lambda: r.engine_busy() == 0, "the engine is left with nothing running")
    assert_hogging(cpu_hog)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_reduced_soak_under_a_cpu_hog_fails_no_fault_free_request(
    kind: Kind, cpu_hog: list[subprocess.Popen[bytes]]
) -> None:
    rng = random.Random(f"starved-{kind}")
    async with rig(kind, token_latency_ms=1, connections=None if kind == "sglang-http" else 4) as r:
        plans = make_plans(rng, SOAK_REQUESTS, 0)
        for plan in plans:
            decide(rng, plan, expected_tokens(r.model, plan.prompt, plan.max_tokens))
            if plan.fault is not None and plan.fault.kind is FaultKind.HANG:
                # A hung request the client does not cancel waits out its deadline: a shorter
                # one keeps the run short (fault-free requests keep the soak's 30 s).
                plan.deadline = min(plan.deadline, 5.0)
            if plan.fault is not None:
                r.faults.add(f"-{plan.public_id}", plan.fault, times=1)
        results = await run_batch(r, plans)
        await until(lambda: r.engine_busy() == 0, f"engine still runs {r.book.running_ids()[:5]}", secs=60)
        assert await r.server.wait_idle(30.0)
        aborts: dict[str, int] = {}
        for rid in r.book.aborts:
            public = rid.rsplit("-", 1)[-1]
            aborts[public] = aborts.get(public, 0) + 1
        ends = {rid.rsplit("-", 1)[-1]: outcome for rid, outcome in outcomes(r.book).items()}
        tally = Tally()
        for res in results:
            check_one(res, tally, aborts.get(res.plan.public_id, 0), ends.get(res.plan.public_id))
        # check_one flags any fault-free request that failed ("a fault-free request failed").
        assert not tally.problems, "\n".join(tally.problems)
        fault_free_ok = [
            res
            for res in results
            if res.plan.fault is None and not res.plan.cancels and res.ended.error is None
        ]
        assert fault_free_ok, "no fault-free request ran"
    assert_hogging(cpu_hog)


@asynccontextmanager
async def starved_fleet() -> AsyncIterator[FrontendStack]:
    async with AsyncExitStack() as stack:
        sidecars: list[Any] = [
            await stack.enter_async_context(vllm_stack(token_latency_ms=15.0)) for _ in range(2)
        ]
        shared = FaultBook()
        for sidecar in sidecars:
            sidecar.engine.faults = shared
        addresses = [f"127.0.0.1:{s.server.port}" for s in sidecars]
        async with frontend_over(addresses, sidecars, formats=(VLLM,)) as fe:
            yield fe


async def test_a_fleet_under_a_cpu_hog_completes_every_stream(cpu_hog: list[subprocess.Popen[bytes]]) -> None:
    streams = 40
    async with starved_fleet() as fe:
        # One worker's engine dies inside its server mid-way; its streams move to the other.
        fe.sidecars[0].engine.faults.add("-s0007", FaultPlan(FaultKind.ENGINE_DIES, after=6), times=1)

        async def one(n: int) -> dict[str, Any]:
            path, body = request_body("vllm", f"s{n:04d}")
            events: list[dict[str, Any]] = []
            async with fe.http.post(fe.url + path, json=body) as response:
                assert response.status == 200
                async for line in response.content:
                    text = line.decode().rstrip("\r\n")
                    if text.startswith("data: ") and text != "data: [DONE]":
                        events.append(json.loads(text[len("data: ") :]))
            return summary("vllm", events)

        results = await asyncio.gather(*(one(n) for n in range(streams)))
        reference = results[0]
        assert len(reference["tokens"]) == MAX_TOKENS
        for n, result in enumerate(results):
            assert result == reference, n  # the migrated stream too, token for token
        assert any(getattr(s.engine, "core_dead", False) for s in fe.sidecars), "the engine died"
    assert_hogging(cpu_hog)
