"""A real ``sidecar-vllm`` process beside a testkit engine registers itself in a real etcd:
the key appears once it serves, goes *before* health turns NOT_SERVING on SIGTERM, expires
with its lease after SIGKILL, and appears late when etcd itself comes up late. An SGLang
prefill sidecar announces its engine, role, data-parallel size and a custom prefix."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any

import anyio
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_common.registration_etcd import EtcdSession, open_session
from sidecar_common.registration_record import decode_record
from tests.e2e_helpers import (
    WAIT,
    free_port,
    generate_six,
    log_lines,
    process,
    public_request,
    script,
    serving_port,
)
from tests.etcd_fixture import EtcdServer
from tests.integration.fleet.helpers import engine_argv, sidecar_argv, wait_key, worker_key

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_serving_sidecar_registers_and_withdraws_before_it_refuses_work(etcd: EtcdServer) -> None:
    engine_port = free_port()
    with (
        process(engine_argv(engine_port, "--token-latency-ms", "20")),
        process(sidecar_argv(engine_port, etcd, "--drain-timeout-secs", "20")) as sidecar,
    ):
        port = serving_port(sidecar)
        key = worker_key(port)
        value = await wait_key(etcd, key, present=True)
        assert value is not None
        assert json.loads(value)["version"], "the sidecar's version is part of the record"
        record = decode_record(value)
        assert (record.address, record.engine, record.model, record.role, record.data_parallel_size) == (
            f"127.0.0.1:{port}",
            "vllm",
            "testkit-model",
            "agg",
            1,
        )

        order: list[str] = []
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            open_session(etcd.endpoint, 5.0) as s,
        ):
            # A long generation in flight: the drain waits for it, so the key would still be
            # there for the whole drain if it were deleted after the drain rather than before.
            generation = sidecar_pb2_grpc.WorkerStub(channel).Generate(
                public_request("long", max_tokens=100_000)
            )
            await anext(aiter(generation))
            health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await anext(aiter(health))).status == SERVING
            revision = (await s.get_prefix(key)).revision

            async def key_deleted() -> None:
                async with s.watch_prefix(key, revision + 1) as events:
                    async for event in events:
                        if event.kind == "delete":
                            order.append("key deleted")
                            return

            async def health_not_serving(session: EtcdSession) -> None:
                async for reply in health:
                    if reply.status == NOT_SERVING:
                        # Linearizable read after seeing NOT_SERVING: the delete, if it came
                        # first, is visible now.
                        present = await session.get(key)
                        order.append("not serving, key " + ("present" if present else "absent"))
                        return

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as observers:
                    # The etcd watch starts at the revision read above, so it sees the delete
                    # even if it is set up after the signal.
                    observers.start_soon(key_deleted)
                    observers.start_soon(health_not_serving, s)
                    sidecar.send_signal(signal.SIGTERM)
            generation.cancel()  # lets the drain finish now
        assert "not serving, key absent" in order, order
        assert "key deleted" in order, order
        assert sidecar.wait(timeout=WAIT) == 0


async def test_a_killed_sidecars_key_expires_with_its_lease(etcd: EtcdServer) -> None:
    engine_port = free_port()
    with (
        process(engine_argv(engine_port)),
        process(sidecar_argv(engine_port, etcd, "--etcd-lease-ttl-secs", "2")) as sidecar,
    ):
        port = serving_port(sidecar)
        key = worker_key(port)
        await wait_key(etcd, key, present=True)
        sidecar.send_signal(signal.SIGKILL)
        sidecar.wait(timeout=WAIT)
        # Nobody deleted it: only the lease expiry can make it go.
        assert await wait_key(etcd, key, present=False) is None


def wait_log_event(proc: subprocess.Popen[str], event: str) -> dict[str, Any]:
    seen = []
    for entry in log_lines(proc):
        seen.append(entry.get("event"))
        if entry.get("event") == event:
            return entry
    raise AssertionError(f"no {event!r} in the log; exit {proc.poll()}; events: {seen}")


async def test_a_sidecar_without_etcd_serves_and_registers_once_etcd_appears(
    etcd_not_started: EtcdServer,
) -> None:
    etcd = etcd_not_started
    engine_port = free_port()
    with process(engine_argv(engine_port)), process(sidecar_argv(engine_port, etcd)) as sidecar:
        port = serving_port(sidecar)
        failure = wait_log_event(sidecar, "etcd registration failed; still serving, will retry")
        assert etcd.endpoint in failure["error"]
        outs = generate_six(port)  # etcd is not on the request path
        assert sum(len(o.token_ids) for o in outs) == 6
        etcd.start()
        value = await wait_key(etcd, worker_key(port), present=True)
        assert value is not None
        assert decode_record(value).address == f"127.0.0.1:{port}"


async def test_an_sglang_prefill_sidecar_registers_its_engine_role_and_data_parallel_size(
    etcd: EtcdServer,
) -> None:
    grpc_port, http_port = free_port(), free_port()
    engine = [
        script("testkit-engine"),
        "sglang",
        "--grpc-listen",
        f"127.0.0.1:{grpc_port}",
        "--http-listen",
        f"127.0.0.1:{http_port}",
        "--served-model-name",
        "fleet-model",
        "--dp-size",
        "2",
        "--disaggregation-mode",
        "prefill",
    ]
    sidecar = [
        script("sidecar-sglang"),
        "--grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--listen",
        "127.0.0.1:0",
        "--grpc-connections",
        "1",
        "--log-format",
        "json",
        "--disaggregation-mode",
        "prefill",
        "--etcd-endpoints",
        etcd.endpoint,
        "--etcd-prefix",
        "/fleet-b/workers",
    ]
    with process(engine), process(sidecar) as proc:
        port = serving_port(proc)
        value = await wait_key(etcd, f"/fleet-b/workers/127.0.0.1:{port}".encode(), present=True)
        assert value is not None
        record = decode_record(value)
        assert (record.engine, record.model, record.role, record.data_parallel_size) == (
            "sglang",
            "fleet-model",
            "prefill",
            2,
        )
