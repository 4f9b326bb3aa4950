"""A small typed face over the ``aetcd`` client: the few etcd v3 calls registration and
discovery need, each bounded by a deadline, every failure one exception type.

One :class:`EtcdSession` is one gRPC channel to one endpoint. Callers that lose it open a new
one (on the next endpoint of their list) after a backoff: that is how a restarted or moved
etcd is found again, and it keeps aetcd's own reconnect machinery out of the picture.

A watch has no natural deadline (it waits for changes); a dead peer is found by gRPC
keepalive pings instead (``_KEEPALIVE_*``), which end the stream with an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import aetcd
import anyio

from sidecar_common.endpoint import parse_host_port
from sidecar_common.retry import Backoff

__all__ = [
    "EtcdError",
    "EtcdSession",
    "PrefixSnapshot",
    "WatchEvent",
    "etcd_backoff",
    "open_session",
]

_T = TypeVar("_T")

# A silent peer (network partition, frozen host) is declared dead after about
# keepalive time + timeout. etcd's default keepalive enforcement allows pings every 5 s.
_KEEPALIVE_TIME_MS: Final = 10_000
_KEEPALIVE_TIMEOUT_MS: Final = 5_000
_CHANNEL_OPTIONS: Final = {
    "grpc.keepalive_time_ms": _KEEPALIVE_TIME_MS,
    "grpc.keepalive_timeout_ms": _KEEPALIVE_TIMEOUT_MS,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
    # Reconnect attempts are ours (a new session after a backoff), so the channel's own
    # backoff must not hold a fresh channel in TRANSIENT_FAILURE for long.
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


class EtcdError(Exception):
    """etcd could not be reached, did not answer in time, or refused the call."""


@dataclass(frozen=True)
class PrefixSnapshot:
    """Every key under a prefix at one store revision."""

    revision: int
    items: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: bytes
    value: bytes  # empty for a delete
    revision: int


# The first pause before etcd is tried again (then doubling, with jitter, up to the cap).
_FIRST_RETRY_SECS: Final = 0.2


def etcd_backoff(cap: float) -> Backoff:
    """The pause between attempts to reach etcd, for the sidecar's registration and the
    frontend's discovery alike: from 0.2 s, doubling up to ``cap``, with the jitter of
    :class:`~sidecar_common.retry.Backoff` (a fleet restarting together does not knock on etcd
    in lockstep)."""
    return Backoff(_FIRST_RETRY_SECS, cap)


class EtcdSession:
    """One client connection; every call is bounded by ``call_timeout``."""

    def __init__(self, client: Any, endpoint: str, call_timeout: float) -> None:
        self._client = client
        self.endpoint = endpoint
        self._timeout = call_timeout

    async def _call(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            with anyio.fail_after(self._timeout):
                return await call()
        except TimeoutError:
            raise EtcdError(f"etcd {self.endpoint}: {what} timed out after {self._timeout:g}s") from None
        except aetcd.ClientError as err:
            raise EtcdError(f"etcd {self.endpoint}: {what} failed: {_describe(err)}") from err

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        lease = await self._call("lease grant", lambda: self._client.lease(ttl))
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns its new TTL (0 when the lease is gone)."""
        reply = await self._call("lease keepalive", lambda: self._client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        await self._call("lease revoke", lambda: self._client.revoke_lease(lease_id))

    async def put(self, key: bytes, value: bytes, lease_id: int) -> None:
        await self._call("put", lambda: self._client.put(key, value, lease=lease_id))

    async def delete(self, key: bytes) -> bool:
        """Delete one key; True if it existed."""
        deleted = await self._call("delete", lambda: self._client.delete(key))
        return deleted is not None

    async def get(self, key: bytes) -> bytes | None:
        found = await self._call("get", lambda: self._client.get(key))
        return None if found is None else bytes(found.value)

    async def get_prefix(self, prefix: bytes) -> PrefixSnapshot:
        found = await self._call("get prefix", lambda: self._client.get_prefix(prefix))
        items = tuple((bytes(kv.key), bytes(kv.value)) for kv in found.kvs)
        return PrefixSnapshot(revision=int(found.header.revision), items=items)

    @asynccontextmanager
    async def watch_prefix(
        self, prefix: bytes, start_revision: int
    ) -> AsyncIterator[AsyncIterator[WatchEvent]]:
        """Events under ``prefix`` from ``start_revision`` on. The iterator ends with EtcdError
        when the stream breaks (etcd gone, revision compacted)."""
        watch = await self._call(
            "watch", lambda: self._client.watch_prefix(prefix, start_revision=start_revision)
        )

        async def events() -> AsyncIterator[WatchEvent]:
            try:
                async for event in watch:
                    kind: Literal["put", "delete"] = "put" if event.kind == "PUT" else "delete"
                    yield WatchEvent(
                        kind, bytes(event.kv.key), bytes(event.kv.value), int(event.kv.mod_revision)
                    )
            except aetcd.ClientError as err:
                raise EtcdError(f"etcd {self.endpoint}: watch broke: {_describe(err)}") from err
            # aetcd ends the iteration without an error when the client is closed under it.
            raise EtcdError(f"etcd {self.endpoint}: watch ended")

        try:
            yield events()
        finally:
            # The stream may already be gone, and then there is nothing to cancel.
            with anyio.move_on_after(self._timeout, shield=True), contextlib.suppress(Exception):
                await watch.cancel()


def _describe(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@asynccontextmanager
async def open_session(endpoint: str, call_timeout: float) -> AsyncIterator[EtcdSession]:
    """A session to ``endpoint`` (host:port), closed on exit (bounded)."""
    address = parse_host_port(endpoint, port_zero_allowed=False)
    client = aetcd.Client(
        host=address.bracketed_host,  # aetcd dials f"{host}:{port}"
        port=address.port,
        timeout=call_timeout,
        options=dict(_CHANNEL_OPTIONS),
        connect_wait_timeout=max(1, int(call_timeout)),
    )
    session = EtcdSession(client, endpoint, call_timeout)
    try:
        yield session
    finally:
        # Closing a broken channel may itself fail; it is gone either way.
        with anyio.move_on_after(call_timeout, shield=True), contextlib.suppress(Exception):
            await client.close()
