"""DNS discovery feeding the real worker set, with real ``sidecar-vllm`` processes. Loopback
has no headless Service: a resolver the test controls stands in for DNS, one name per
sidecar (they share 127.0.0.1 and differ by port)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from sidecar_frontend.discovery import DiscoveryConfig, run_discovery
from sidecar_frontend.discovery_records import DnsTarget
from sidecar_frontend.workers import WorkerSet
from tests.e2e_helpers import WAIT, free_port, process, until
from tests.integration.fleet.helpers import engine_argv, static_sidecar_argv

pytestmark = pytest.mark.timeout(120)


async def test_pods_in_and_out_of_dns_join_and_leave_the_worker_set() -> None:
    engine_port, first_port, second_port = free_port(), free_port(), free_port()
    answers: dict[str, list[str]] = {"first": ["127.0.0.1"], "second": []}

    async def resolver(host: str, port: int) -> Sequence[str]:
        return answers[host]

    config = DiscoveryConfig(
        mode="dns",
        dns_targets=(DnsTarget("first", first_port), DnsTarget("second", second_port)),
        dns_refresh=0.1,
    )
    first, second = f"127.0.0.1:{first_port}", f"127.0.0.1:{second_port}"
    with (
        process(engine_argv(engine_port)),
        process(static_sidecar_argv(engine_port, first_port)),
        process(static_sidecar_argv(engine_port, second_port)),
    ):
        async with WorkerSet() as workers, anyio.create_task_group() as tg:
            await tg.start(
                lambda task_status: run_discovery(config, workers, resolver=resolver, task_status=task_status)
            )
            with anyio.fail_after(WAIT):
                await workers.wait_serving(1)
            assert {w.address for w in workers.serving()} == {first}

            answers["second"] = ["127.0.0.1"]  # a Pod became ready
            with anyio.fail_after(WAIT):
                await workers.wait_serving(2)
            assert {w.address for w in workers.serving()} == {first, second}

            answers["first"] = []  # a Pod deleted: gone from the headless Service
            await until(lambda: first not in workers.addresses(), "the Pod gone from DNS is drained", WAIT)
            assert {w.address for w in workers.serving()} == {second}
            tg.cancel_scope.cancel()
