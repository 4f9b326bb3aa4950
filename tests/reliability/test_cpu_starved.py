"""Under CPU starvation nothing that would succeed fails.

A fixture saturates every core with a busy-looping process at the sidecar's own priority (as
other work on a shared machine would), then the engine-death, soak (at a reduced scale) and
fleet (in process, and as real processes) scenarios run, and every fault-free request must
succeed: a busy engine answers its
health probes late, which is not death (docs/common.md, "Engine health")."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import aiohttp
import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_server.server import ServerConfig
from tests.e2e_helpers import WAIT, free_port, script
from tests.integration.fleet.helpers import engine_argv, static_sidecar_argv
from tests.integration.frontend.fixtures import sse_json_events, two_workers
from tests.integration.frontend.test_migration_e2e import MAX_TOKENS, request_body, summary
from tests.process.test_fleet_faults import serving_line, start
from tests.reliability.harness import KINDS, Kind, expected_tokens, outcomes, rig, until
from tests.reliability.test_engine_death import WATCH, death_and_return
from tests.reliability.test_soak import Tally, check_one, decide, make_plans, run_batch

# cpu_hog: the hog must be the only other load, so `make test` runs these after the rest, alone
# (docs/testing.md).
pytestmark = [pytest.mark.slow, pytest.mark.cpu_hog, pytest.mark.timeout(300)]

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
        # It accepts any deadline expiry; here a request with the soak's long deadline that
        # was not hung by its fault must have ended before it.
        for res in results:
            hung = res.plan.fault is not None and res.plan.fault.kind is FaultKind.HANG
            if res.ended.code is grpc.StatusCode.DEADLINE_EXCEEDED and not hung and res.plan.deadline >= 30:
                tally.bad(res.plan, "ran into its 30 s deadline although nothing held it")
        assert not tally.problems, "\n".join(tally.problems)
        fault_free_ok = [
            res
            for res in results
            if res.plan.fault is None and not res.plan.cancels and res.ended.error is None
        ]
        assert fault_free_ok, "no fault-free request ran"
    assert_hogging(cpu_hog)


async def test_a_fleet_under_a_cpu_hog_completes_every_stream(cpu_hog: list[subprocess.Popen[bytes]]) -> None:
    streams = 40
    async with two_workers("vllm", formats=(VLLM,), shared_faults=True) as fe:
        # One worker's engine dies inside its server mid-way; its streams move to the other.
        fe.sidecars[0].engine.faults.add("-s0007", FaultPlan(FaultKind.ENGINE_DIES, after=6), times=1)

        async def one(n: int) -> dict[str, Any]:
            path, body = request_body("vllm", f"s{n:04d}")
            async with fe.http.post(fe.url + path, json=body) as response:
                assert response.status == 200
                return summary("vllm", await sse_json_events(response))

        results = await asyncio.gather(*(one(n) for n in range(streams)))
        reference = results[0]
        assert len(reference["tokens"]) == MAX_TOKENS
        for n, result in enumerate(results):
            assert result == reference, n  # the migrated stream too, token for token
        assert any(getattr(s.engine, "core_dead", False) for s in fe.sidecars), "the engine died"
    assert_hogging(cpu_hog)


def test_a_process_fleet_under_a_cpu_hog_completes_every_stream(
    cpu_hog: list[subprocess.Popen[bytes]],
) -> None:
    """Every part a real process (two testkit vLLM engines, their sidecars, a frontend with
    static workers): 60 streams, 20 of which make the first engine's core die under them (that
    engine alone has the fault installed), all complete with the no-failure output."""
    with ExitStack() as stack:
        engine_ports = [free_port() for _ in range(2)]
        for index, port in enumerate(engine_ports):
            fault = ["--fault", "victim=engine_dies:4"] if index == 0 else []
            start(stack, engine_argv(port, "--token-latency-ms", "15", *fault))
        sidecar_ports = [free_port() for _ in range(2)]
        for engine_port, port in zip(engine_ports, sidecar_ports, strict=True):
            start(stack, static_sidecar_argv(engine_port, port)).first(lambda e: e.get("event") == "serving")
        addresses = [f"127.0.0.1:{port}" for port in sidecar_ports]
        workers = [arg for address in addresses for arg in ("--worker", address)]
        frontend = start(
            stack,
            [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json", *workers],
        )
        url = f"http://127.0.0.1:{frontend.port()}"
        for address in addresses:
            frontend.first(serving_line(address))

        async def scenario() -> list[dict[str, Any]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

                async def one(n: int) -> dict[str, Any]:
                    rid = f"s{n:04d}-victim" if n % 3 == 0 else f"s{n:04d}"
                    path, body = request_body("vllm", rid)
                    async with http.post(url + path, json=body) as response:
                        assert response.status == 200, await response.text()
                        events = await sse_json_events(response)
                    return summary("vllm", events)

                return list(await asyncio.gather(*(one(n) for n in range(60))))

        results = asyncio.run(scenario())
        reference = results[1]
        assert len(reference["tokens"]) == MAX_TOKENS
        for n, result in enumerate(results):
            assert result == reference, n  # the moved streams too, token for token
        # The first engine's core did die under its streams (its server still answers).
        with grpc.insecure_channel(f"127.0.0.1:{engine_ports[0]}") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            reply = stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=WAIT)
            assert not reply.healthy
    assert_hogging(cpu_hog)
