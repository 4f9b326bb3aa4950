"""``python -m bench.fault_timings [--rounds N]``: how fast faults end what they must end.

What the reliability tests once asserted as time bounds (they now only assert that it happens):
in process, a testkit engine of each kind, its adapter and a ``SidecarServer`` on loopback.

* ``engine_death``: 100 streams in flight, the engine dies (connections cut): from the kill to
  the last stream's end, and how long a new request then takes to fail;
* ``core_death`` (vLLM): the engine core dies inside its live server: from the death to the
  last of 20 streams' migratable end (the sidecar probes the engine's health first);
* ``hung_deadline``: a hung engine and a client deadline of 0.5 s: the call's duration;
* ``hung_drain``: a hung generation under a drain of drain_timeout 0.5 s, abort_timeout 1 s:
  the drain's duration.

Prints one line per kind and measurement (median and max over the rounds, in seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import structlog
from testkit.faults import FaultKind, FaultPlan
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.pool import PoolConfig, RetryPolicy
from sidecar_server.config import SidecarConfig
from sidecar_server.engine import Engine
from sidecar_server.server import ServerConfig, SidecarServer
from sidecar_sglang.grpc_transport import over_grpc
from sidecar_sglang.http_transport import over_http
from sidecar_vllm.engine import VllmEngine

Kind = Literal["vllm", "sglang-grpc", "sglang-http"]
KINDS: tuple[Kind, ...] = ("vllm", "sglang-grpc", "sglang-http")
PROMPT = [101, 202, 303]


def _config(port: int, connections: int) -> SidecarConfig:
    retry = RetryPolicy(attempt_timeout=1.0, max_interval=0.1, initial_interval=0.02)
    pool = PoolConfig(
        parse_endpoint(f"127.0.0.1:{port}"), connections=connections, startup_deadline=10, retry=retry
    )
    return SidecarConfig(pool=pool, listen="127.0.0.1:0")


@dataclass
class _Rig:
    engine: VllmTestEngine | SglangTestEngine
    server: SidecarServer
    stub: Any

    async def kill(self) -> None:
        if isinstance(self.engine, VllmTestEngine):
            await self.engine.die()
        else:
            await self.engine.kill()


@asynccontextmanager
async def _rig(kind: Kind, server: ServerConfig) -> AsyncIterator[_Rig]:
    adapter: Engine
    engine: VllmTestEngine | SglangTestEngine
    if kind == "vllm":
        engine = VllmTestEngine(VllmEngineConfig(token_latency_ms=20))
        adapter = VllmEngine(_config(await engine.start(), 2))
    else:
        engine = SglangTestEngine(SglangEngineConfig(token_latency_ms=20))
        await engine.start()
        if kind == "sglang-grpc":
            adapter = over_grpc(_config(engine.grpc_port, 2))
        else:
            adapter = over_http(
                _config(engine.grpc_port or 1, 200), parse_endpoint(f"127.0.0.1:{engine.http_port}")
            )
    sidecar = SidecarServer(adapter, server)
    await adapter.start()
    await sidecar.start()
    sidecar.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}")
    try:
        yield _Rig(engine, sidecar, sidecar_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close(None)
        await sidecar.stop()
        await adapter.close()
        if isinstance(engine, VllmTestEngine):
            await engine.stop(0)
        else:
            await engine.stop()


def _request(public_id: str, max_tokens: int, deadline: float = 60.0) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id=public_id, token_ids=PROMPT)
    req.stop_conditions.max_tokens = max_tokens
    return req


async def _drain_call(call: Any) -> None:
    try:
        while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
            pass
    except grpc.aio.AioRpcError:
        pass


async def _opened(stub: Any, count: int, prefix: str) -> list[Any]:
    calls = [stub.Generate(_request(f"{prefix}{i}", 1000), timeout=60) for i in range(count)]
    for call in calls:
        await call.read()
    return calls


async def _engine_death(kind: Kind) -> dict[str, float]:
    async with _rig(kind, ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2)) as r:
        calls = await _opened(r.stub, 100, "d")
        t0 = time.monotonic()
        await r.kill()
        await asyncio.gather(*(_drain_call(c) for c in calls))
        ended = time.monotonic() - t0
        t1 = time.monotonic()
        await _drain_call(r.stub.Generate(_request("new", 5), timeout=30))
        return {"streams_end": ended, "new_request_fails": time.monotonic() - t1}


async def _core_death(kind: Kind) -> dict[str, float]:
    async with _rig(kind, ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2)) as r:
        calls = await _opened(r.stub, 20, "c")
        t0 = time.monotonic()
        if isinstance(r.engine, VllmTestEngine):
            await r.engine.core_dies()
        else:
            r.engine.scheduler_dies()
        await asyncio.gather(*(_drain_call(c) for c in calls))
        return {"streams_end": time.monotonic() - t0}


async def _hung_deadline(kind: Kind) -> dict[str, float]:
    async with _rig(kind, ServerConfig(listen="127.0.0.1:0", health_watch_interval=0.2)) as r:
        r.engine.faults.add("-hung", FaultPlan(FaultKind.HANG, after=3))
        t0 = time.monotonic()
        await _drain_call(r.stub.Generate(_request("hung", 50), timeout=0.5))
        return {"deadline_0.5s_call": time.monotonic() - t0}


async def _hung_drain(kind: Kind) -> dict[str, float]:
    config = ServerConfig(
        listen="127.0.0.1:0", drain_timeout=0.5, abort_timeout=1.0, health_watch_interval=0.2
    )
    async with _rig(kind, config) as r:
        r.engine.faults.add("-hung", FaultPlan(FaultKind.HANG, after=2))
        call = r.stub.Generate(_request("hung", 50), timeout=60)
        await call.read()
        await call.read()
        t0 = time.monotonic()
        await r.server.drain()
        took = time.monotonic() - t0
        await _drain_call(call)
        return {"drain_0.5s_abort_1s": took}


SCENARIOS: dict[str, Callable[[Kind], Awaitable[dict[str, float]]]] = {
    "engine_death": _engine_death,
    "core_death": _core_death,
    "hung_deadline": _hung_deadline,
    "hung_drain": _hung_drain,
}


async def _main(rounds: int) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    for name, scenario in SCENARIOS.items():
        for kind in KINDS:
            samples: dict[str, list[float]] = {}
            for _ in range(rounds):
                for key, value in (await scenario(kind)).items():
                    samples.setdefault(key, []).append(value)
            for key, values in samples.items():
                print(
                    f"{name:14s} {kind:12s} {key:22s} median {statistics.median(values):.3f}s"
                    f" max {max(values):.3f}s (n={len(values)})",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario and kind (default 3)")
    args = parser.parse_args()
    asyncio.run(_main(args.rounds))


if __name__ == "__main__":
    main()
