"""The frontend's etcd discovery against a real etcd server, feeding a recording sink:
keys coming and going, bad values, lease expiry, and etcd going away and coming back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from sidecar_common.registration_etcd import EtcdSession, open_session
from sidecar_common.registration_record import DEFAULT_PREFIX, WorkerRecord, encode_record, record_key
from sidecar_frontend.discovery import DiscoveryConfig, run_discovery
from tests.e2e_helpers import free_port
from tests.etcd_fixture import EtcdServer
from tests.fleet_helpers import RecordingSink

pytestmark = pytest.mark.timeout(90)

PREFIX = DEFAULT_PREFIX


def record(address: str, role: str = "agg") -> bytes:
    return encode_record(WorkerRecord(address=address, engine="vllm", model="m", role=role))  # type: ignore[arg-type]


def key(address: str) -> bytes:
    return record_key(PREFIX, address)


@asynccontextmanager
async def session(etcd: EtcdServer) -> AsyncIterator[EtcdSession]:
    async with open_session(etcd.endpoint, 5.0) as s:
        yield s


@asynccontextmanager
async def discovering(endpoint: str, sink: RecordingSink, reconcile: float = 0.1) -> AsyncIterator[None]:
    config = DiscoveryConfig(
        mode="etcd",
        etcd_endpoints=(endpoint,),
        etcd_call_timeout=2.0,
        etcd_retry_max_interval=0.3,
        reconcile_interval=reconcile,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(run_discovery, config, sink)
        yield
        tg.cancel_scope.cancel()


async def test_keys_coming_and_going_add_and_drain_workers(etcd: EtcdServer) -> None:
    sink = RecordingSink()
    async with session(etcd) as s:
        lease = await s.grant(30)
        await s.put(key("10.0.0.1:50061"), record("10.0.0.1:50061"), lease)
        await s.put(b"/elsewhere/10.0.0.9:1", record("10.0.0.9:1"), lease)
        async with discovering(etcd.endpoint, sink):
            # The listing at start-up: only keys under the prefix.
            await sink.wait_for(lambda k: "10.0.0.1:50061" in k.serving(), "the registered worker added")
            assert sink.calls == [("add", "10.0.0.1:50061", "agg")]

            await s.put(key("10.0.0.2:50061"), record("10.0.0.2:50061", "prefill"), lease)
            await sink.wait_for(lambda k: "10.0.0.2:50061" in k.serving(), "a new key adds its worker")
            assert sink.serving()["10.0.0.2:50061"] == "prefill", "the role comes from the value"

            await s.put(key("junk"), b"not json", lease)
            await s.delete(key("10.0.0.1:50061"))
            await sink.wait_for(lambda k: "10.0.0.1:50061" in k.draining, "a deleted key drains its worker")
            # The bad value came first (etcd orders events), so by now it was seen and ignored.
            assert [c for c in sink.calls if c[1] not in ("10.0.0.1:50061", "10.0.0.2:50061")] == []

            await s.revoke(lease)  # every key on the lease goes at once, as on expiry
            await sink.wait_for(lambda k: "10.0.0.2:50061" in k.draining, "the revoked lease drains")
            assert sink.serving() == {}


async def test_a_dead_sidecars_lease_expiry_drains_it(etcd: EtcdServer) -> None:
    sink = RecordingSink()
    async with session(etcd) as s, discovering(etcd.endpoint, sink):
        lease = await s.grant(2)  # never refreshed: the owner "died"
        await s.put(key("10.0.0.3:50061"), record("10.0.0.3:50061", "decode"), lease)
        await sink.wait_for(lambda k: k.serving() == {"10.0.0.3:50061": "decode"}, "added")
        await sink.wait_for(lambda k: "10.0.0.3:50061" in k.draining, "drained once the lease expired")


@pytest.mark.parametrize("reconcile", [0.1, 3600.0], ids=["timer", "event"])
async def test_a_worker_drained_and_registered_again_is_added_again_once_forgotten(
    etcd: EtcdServer, reconcile: float
) -> None:
    """With an hour between reconciliations, the set's own change (it forgot the worker)
    brings the add at once."""
    sink = RecordingSink()
    address = "10.0.0.4:50061"
    async with session(etcd) as s, discovering(etcd.endpoint, sink, reconcile):
        lease = await s.grant(30)
        await s.put(key(address), record(address), lease)
        await sink.wait_for(lambda k: address in k.serving(), "added")
        await s.delete(key(address))
        await s.put(key(address), record(address), lease)  # a quick restart of the sidecar
        await sink.wait_for(lambda k: k.calls.count(("add", address, "agg")) == 2, "the add after the drain")
        assert address in sink.draining, "the sink ignores an add while it drains the address"
        sink.forget(address)  # the drained worker became idle
        await sink.wait_for(lambda k: address in k.serving(), "discovery adds it again once forgotten")


class Partition:
    """A TCP relay between discovery and etcd that can be cut (every connection closed, new
    ones accepted and closed at once, counted) and healed: a network partition on loopback."""

    def __init__(self, upstream_port: int) -> None:
        self.port = free_port()
        self.upstream_port = upstream_port
        self.cut = False
        self.refused = 0
        self._refused_event = anyio.Event()
        self._links: set[anyio.abc.SocketStream] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        task_status.started()
        await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            if self.cut:
                self.refused += 1
                self._refused_event.set()
                return
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", self.upstream_port)
            except OSError:
                return
            self._links |= {client, upstream}
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, tg.cancel_scope)
                tg.start_soon(self._pump, upstream, client, tg.cancel_scope)
            self._links -= {client, upstream}

    async def _pump(
        self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, scope: anyio.CancelScope
    ) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    async def sever(self) -> None:
        self.cut = True
        for link in list(self._links):
            await link.aclose()

    async def wait_refused(self, count: int) -> None:
        with anyio.fail_after(30):
            while self.refused < count:
                await self._refused_event.wait()
                self._refused_event = anyio.Event()

    def heal(self) -> None:
        self.cut = False


async def test_etcd_restarted_while_discovery_runs_keeps_the_view_and_catches_up(etcd: EtcdServer) -> None:
    sink = RecordingSink()
    stays, leaves, arrives = "10.0.1.1:50061", "10.0.1.2:50061", "10.0.1.3:50061"
    partition = Partition(etcd.client_port)
    async with anyio.create_task_group() as relay:
        await relay.start(partition.serve)
        async with session(etcd) as s:
            lease = await s.grant(60)
            await s.put(key(stays), record(stays), lease)
            await s.put(key(leaves), record(leaves), lease)
        async with discovering(partition.endpoint, sink):
            await sink.wait_for(lambda k: set(k.serving()) == {stays, leaves}, "both workers added")

            await partition.sever()
            etcd.restart()  # a real restart, same data: the lease and the keys survive
            # Discovery has noticed (it is knocking again) and still holds its last view.
            await partition.wait_refused(2)
            assert set(sink.serving()) == {stays, leaves}
            assert not any(c[0] == "drain" for c in sink.calls)

            # Changes made while discovery cannot see etcd.
            async with session(etcd) as s:
                await s.delete(key(leaves))
                await s.put(key(arrives), record(arrives, "decode"), lease)

            partition.heal()
            await sink.wait_for(
                lambda k: k.serving() == {stays: "agg", arrives: "decode"}, "caught up after reconnecting"
            )
            assert leaves in sink.draining
            assert sink.calls.count(("add", stays, "agg")) == 1, "an unchanged worker is not re-added"

            # And it watches again: a change after the reconnect arrives as an event.
            async with session(etcd) as s:
                await s.delete(key(arrives))
            await sink.wait_for(lambda k: arrives in k.draining, "watching again after the catch-up")
        relay.cancel_scope.cancel()


async def test_discovery_starts_without_etcd_and_syncs_when_it_appears(etcd_not_started: EtcdServer) -> None:
    sink = RecordingSink()
    etcd = etcd_not_started
    async with discovering(etcd.endpoint, sink):
        # started() came after the first failed attempt: the frontend runs with no workers.
        assert sink.calls == []
        etcd.start()
        async with session(etcd) as s:
            lease = await s.grant(30)
            await s.put(key("10.0.2.1:50061"), record("10.0.2.1:50061"), lease)
        await sink.wait_for(lambda k: "10.0.2.1:50061" in k.serving(), "found once etcd is up")


async def test_a_dead_endpoint_in_the_list_is_passed_over(etcd: EtcdServer) -> None:
    sink = RecordingSink()
    dead = f"127.0.0.1:{free_port()}"
    async with session(etcd) as s:
        lease = await s.grant(30)
        await s.put(key("10.0.3.1:50061"), record("10.0.3.1:50061"), lease)
    config = DiscoveryConfig(
        mode="etcd", etcd_endpoints=(dead, etcd.endpoint), etcd_call_timeout=2.0, etcd_retry_max_interval=0.3
    )
    async with anyio.create_task_group() as tg:
        await tg.start(run_discovery, config, sink)
        await sink.wait_for(lambda k: "10.0.3.1:50061" in k.serving(), "found through the second endpoint")
        tg.cancel_scope.cancel()
