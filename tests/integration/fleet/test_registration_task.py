"""The registration task in-process against a real etcd: a lease lost behind its back is
replaced, the withdrawal deletes the key and is bounded even when etcd is unreachable."""

from __future__ import annotations

import anyio
import pytest

from sidecar_common.registration_etcd import open_session
from sidecar_common.registration_record import RegistrationConfig, WorkerRecord, decode_record
from sidecar_server.registration import Registration, registered
from tests.e2e_helpers import WAIT, free_port
from tests.etcd_fixture import EtcdServer
from tests.integration.fleet.helpers import wait_key

pytestmark = pytest.mark.timeout(60)

RECORD = WorkerRecord(
    address="10.9.0.1:50061", engine="sglang", model="m", role="prefill", data_parallel_size=2
)


def config(endpoint: str, **overrides: object) -> RegistrationConfig:
    settings: dict[str, object] = {"endpoints": (endpoint,), "lease_ttl": 2, "call_timeout": 1.0}
    settings.update(overrides)
    return RegistrationConfig(**settings)  # type: ignore[arg-type]


async def test_registers_then_withdraws(etcd: EtcdServer) -> None:
    async with registered(config(etcd.endpoint), RECORD) as registration:
        value = await wait_key(etcd, registration.key, present=True)
        assert value is not None
        assert decode_record(value) == RECORD
        await registration.withdraw()
        async with open_session(etcd.endpoint, 5.0) as s:
            assert await s.get(registration.key) is None, "gone as soon as withdraw returns"
        await registration.withdraw()  # a second call is harmless


async def test_a_lease_lost_behind_its_back_is_replaced(etcd: EtcdServer) -> None:
    async with registered(config(etcd.endpoint), RECORD) as registration:
        await wait_key(etcd, registration.key, present=True)
        async with open_session(etcd.endpoint, 5.0) as s:
            leases = await s.get_prefix(registration.key)
            assert len(leases.items) == 1
            # What etcd losing its data (or an expiry during a long partition) looks like to
            # the sidecar: its lease is gone, and its key with it.
            lease_id = await _lease_of(s, registration.key)
            await s.revoke(lease_id)
        await wait_key(etcd, registration.key, present=False)
        await wait_key(etcd, registration.key, present=True)  # registered again, new lease


async def _lease_of(session: object, key: bytes) -> int:
    client = session._client  # type: ignore[attr-defined]
    found = await client.get(key)
    return int(found.lease)


async def test_withdrawing_without_etcd_is_bounded(etcd_not_started: EtcdServer) -> None:
    registration = Registration(config(etcd_not_started.endpoint, retry_max_interval=0.2), RECORD)
    async with anyio.create_task_group() as tg:
        tg.start_soon(registration.run)
        with anyio.fail_after(registration.withdraw_bound + 1):
            await registration.withdraw()
        assert not registration.registered.is_set()
    # run() has returned on its own: the task group did not need cancelling.


async def test_registers_once_etcd_comes_up(
    etcd_not_started: EtcdServer,
) -> None:
    etcd = etcd_not_started
    async with registered(config(etcd.endpoint, retry_max_interval=0.3), RECORD) as registration:
        etcd.start()
        with anyio.fail_after(WAIT):
            await registration.registered.wait()
        value = await wait_key(etcd, registration.key, present=True)
        assert value is not None
        assert decode_record(value) == RECORD


async def test_a_dead_endpoint_in_the_list_is_passed_over(etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    settings = RegistrationConfig(
        endpoints=(dead, etcd.endpoint), lease_ttl=2, call_timeout=1.0, retry_max_interval=0.3
    )
    async with registered(settings, RECORD) as registration:
        with anyio.fail_after(WAIT):
            await registration.registered.wait()
        assert await wait_key(etcd, registration.key, present=True) is not None
