"""The whole loop on loopback: real ``sidecar-vllm`` processes register in a real etcd, the
frontend's etcd discovery feeds the real worker set, which takes a new sidecar into service
and lets a withdrawn one go."""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.discovery import DiscoveryConfig, run_discovery
from sidecar_frontend.workers import WorkerSet
from tests.e2e_helpers import WAIT, free_port, process, public_request, serving_port, until
from tests.etcd_fixture import EtcdServer
from tests.integration.fleet.helpers import engine_argv, sidecar_argv

pytestmark = pytest.mark.timeout(120)


async def generate_on(workers: WorkerSet) -> str:
    """One short generation on the worker the set picks; returns that worker's address."""
    worker = workers.pick()
    assert worker is not None, "no serving worker"
    with anyio.fail_after(WAIT):
        outs = [o async for o in worker.stub().Generate(public_request("fleet", max_tokens=3))]
    assert outs[-1].finish_reason == sidecar_pb2.LENGTH
    return worker.address


async def test_registered_sidecars_take_traffic_and_a_withdrawn_one_is_let_go(etcd: EtcdServer) -> None:
    first_engine, second_engine = free_port(), free_port()
    config = DiscoveryConfig(mode="etcd", etcd_endpoints=(etcd.endpoint,), etcd_call_timeout=2.0)
    with (
        process(engine_argv(first_engine)),
        process(engine_argv(second_engine)),
        process(sidecar_argv(first_engine, etcd, "--drain-timeout-secs", "5")) as first,
    ):
        first_address = f"127.0.0.1:{serving_port(first)}"
        async with WorkerSet() as workers, anyio.create_task_group() as tg:
            await tg.start(run_discovery, config, workers)
            with anyio.fail_after(WAIT):
                await workers.wait_serving(1)
            assert await generate_on(workers) == first_address

            with process(sidecar_argv(second_engine, etcd)) as second:
                second_address = f"127.0.0.1:{serving_port(second)}"
                started = time.monotonic()
                await until(
                    lambda: second_address in {w.address for w in workers.serving()}, "second serving"
                )
                print(f"worker set: new worker serving {time.monotonic() - started:.3f}s after it served")

                first.send_signal(signal.SIGTERM)
                await until(
                    lambda: first_address not in workers.addresses(), "withdrawn worker forgotten", WAIT
                )
                assert first.wait(timeout=WAIT) == 0
                assert {w.address for w in workers.serving()} == {second_address}
                assert await generate_on(workers) == second_address
            tg.cancel_scope.cancel()
