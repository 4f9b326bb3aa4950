"""DNS and static discovery feeding a recording sink. Loopback has no headless Service, so
the resolver is a fake the test controls; the loop, its refreshes and the sink calls are real."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import pytest

from sidecar_frontend.discovery import DiscoveryConfig, run_discovery, system_resolver
from sidecar_frontend.discovery_records import DnsTarget
from tests.fleet_helpers import RecordingSink

pytestmark = pytest.mark.timeout(30)

WORKERS = DnsTarget("workers.ns.svc.cluster.local", 50061)
PREFILL = DnsTarget("prefill.ns.svc.cluster.local", 6000, "prefill")


class FakeResolver:
    """Answers from ``answers``; a name mapped to an exception raises it. Counts lookups so
    a test can wait for the loop to have run a number of refreshes."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.lookups = 0
        self._looked_up = anyio.Event()

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.lookups += 1
        self._looked_up.set()
        self._looked_up = anyio.Event()
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def wait_lookups(self, more: int) -> None:
        target = self.lookups + more
        with anyio.fail_after(10):
            while self.lookups < target:
                await self._looked_up.wait()


@asynccontextmanager
async def discovering(
    sink: RecordingSink, resolver: FakeResolver, *targets: DnsTarget
) -> AsyncIterator[None]:
    config = DiscoveryConfig(mode="dns", dns_targets=targets, dns_refresh=0.01, dns_timeout=1.0)
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: run_discovery(config, sink, resolver=resolver, task_status=task_status)
        )
        yield
        tg.cancel_scope.cancel()


async def test_pods_appearing_and_disappearing_are_added_and_drained() -> None:
    sink, resolver = RecordingSink(), FakeResolver()
    resolver.answers = {WORKERS.host: ["10.0.0.1", "10.0.0.2"], PREFILL.host: ["10.0.1.1"]}
    async with discovering(sink, resolver, WORKERS, PREFILL):
        # started() comes after the first round: the first view is already applied.
        assert sink.serving() == {
            "10.0.0.1:50061": "agg",
            "10.0.0.2:50061": "agg",
            "10.0.1.1:6000": "prefill",
        }

        resolver.answers[WORKERS.host] = ["10.0.0.2", "10.0.0.3"]  # a Pod replaced
        await sink.wait_for(lambda k: "10.0.0.3:50061" in k.serving(), "the new Pod added")
        assert "10.0.0.1:50061" in sink.draining, "the Pod gone from DNS is drained"
        assert sink.calls.count(("add", "10.0.0.2:50061", "agg")) == 1, "a Pod still listed is left alone"


async def test_a_failing_lookup_keeps_the_last_answer() -> None:
    sink, resolver = RecordingSink(), FakeResolver()
    resolver.answers = {WORKERS.host: ["10.0.0.1"], PREFILL.host: ["10.0.1.1"]}
    async with discovering(sink, resolver, WORKERS, PREFILL):
        calls = len(sink.calls)
        resolver.answers[WORKERS.host] = OSError("Name or service not known")
        resolver.answers[PREFILL.host] = ["10.0.1.2"]
        await sink.wait_for(lambda k: "10.0.1.2:6000" in k.serving(), "the working name still updates")
        await resolver.wait_lookups(6)  # three more refreshes of both names
        assert sink.serving() == {"10.0.0.1:50061": "agg", "10.0.1.2:6000": "prefill"}
        assert sink.calls[calls:] == [("drain", "10.0.1.1:6000", ""), ("add", "10.0.1.2:6000", "prefill")]

        resolver.answers[WORKERS.host] = []  # resolving again, to nothing: that is an answer
        await sink.wait_for(lambda k: "10.0.0.1:50061" in k.draining, "drained once DNS answers without it")


async def test_a_hung_lookup_is_bounded_and_counts_as_a_failure() -> None:
    sink, fake = RecordingSink(), FakeResolver()
    fake.answers = {WORKERS.host: ["10.0.0.1"]}

    async def resolver(host: str, port: int) -> Sequence[str]:
        answer = await fake(host, port)
        if fake.lookups > 1:
            await anyio.sleep_forever()  # a DNS server that never answers
        return answer

    config = DiscoveryConfig(mode="dns", dns_targets=(WORKERS,), dns_refresh=0.01, dns_timeout=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: run_discovery(config, sink, resolver=resolver, task_status=task_status)
        )
        # Each hung lookup is given up after dns_timeout, and the loop goes on refreshing.
        await fake.wait_lookups(3)
        assert sink.serving() == {"10.0.0.1:50061": "agg"}
        tg.cancel_scope.cancel()


async def test_a_restarted_pod_with_the_same_address_is_added_again_once_forgotten() -> None:
    sink, resolver = RecordingSink(), FakeResolver()
    resolver.answers = {WORKERS.host: ["10.0.0.1"]}
    async with discovering(sink, resolver, WORKERS):
        resolver.answers[WORKERS.host] = []
        await sink.wait_for(lambda k: "10.0.0.1:50061" in k.draining, "drained")
        resolver.answers[WORKERS.host] = ["10.0.0.1"]  # back while the set still drains it
        await sink.wait_for(lambda k: k.calls.count(("add", "10.0.0.1:50061", "agg")) >= 2, "re-added")
        assert "10.0.0.1:50061" not in sink.serving(), "ignored while draining (as the worker set does)"
        sink.forget("10.0.0.1:50061")
        await sink.wait_for(lambda k: "10.0.0.1:50061" in k.serving(), "added again once forgotten")


async def test_static_discovery_adds_the_list_once_and_returns() -> None:
    sink = RecordingSink()
    config = DiscoveryConfig(mode="static", static_workers=(("10.0.0.1:1", "agg"), ("10.0.0.2:1", "decode")))
    with anyio.fail_after(5):
        await run_discovery(config, sink)
    assert sink.calls == [("add", "10.0.0.1:1", "agg"), ("add", "10.0.0.2:1", "decode")]


async def test_the_system_resolver_resolves_localhost() -> None:
    with anyio.fail_after(10):
        assert "127.0.0.1" in await system_resolver("localhost", 50061)
