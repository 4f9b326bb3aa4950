"""A serving sidecar announces itself in etcd, and withdraws before it drains.

Once the sidecar is SERVING, :func:`registered` keeps one key ``<prefix><address>`` (value:
:func:`~sidecar_common.registration_record.encode_record`) attached to a lease it refreshes
every third of the TTL. On a stop signal the daemon calls :meth:`Registration.withdraw`
*before* the drain: the key is deleted first (frontends watching the prefix stop routing
here), then the lease is revoked, and only then does the server refuse work. A sidecar that
dies without withdrawing disappears when its lease expires.

etcd is not on the request path: a sidecar that cannot reach it still serves gRPC, logs the
failure and keeps trying, over the endpoints in turn, with the project's one backoff
(:func:`~sidecar_common.registration_etcd.etcd_backoff`: from 0.2 s, doubling up to
``retry_max_interval``, with jitter; from 0.2 s again after a registration that was in place
is lost). Every
etcd call is bounded by ``call_timeout``; the withdrawal as a whole by
:attr:`Registration.withdraw_bound`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import structlog

from sidecar_common.registration_etcd import EtcdError, EtcdSession, etcd_backoff, open_session
from sidecar_common.registration_record import (
    RegistrationConfig,
    WorkerRecord,
    encode_record,
    record_key,
)
from sidecar_common.retry import RetryForever

__all__ = ["Registration", "registered"]

log = structlog.get_logger("sidecar_server.registration")

_MIN_REFRESH_SECS = 0.5


class Registration:
    """Keeps one worker key alive in etcd until :meth:`withdraw`. :meth:`run` is the task."""

    def __init__(self, config: RegistrationConfig, record: WorkerRecord) -> None:
        self._config = config
        self.record = record
        self.key = record_key(config.prefix, record.address)
        self._value = encode_record(record)
        self._stop = anyio.Event()
        self._done = anyio.Event()
        # Set by the first successful registration.
        self.registered = anyio.Event()
        # The lease of the last registration, until the key is known deleted.
        self._lease: int | None = None
        self._attempts = 0  # sessions opened, which picks the next endpoint in turn
        self._retrying = RetryForever(
            etcd_backoff(config.retry_max_interval),
            # Any failure: a bug here must not take the serving sidecar down.
            retry_on=lambda _: True,
            on_retry=self._report_failure,
            stop=self._stop.is_set,  # withdrawing: run() goes on with a fresh session
            sleep=self._pause,
        )

    @property
    def withdraw_bound(self) -> float:
        """Longest :meth:`withdraw` waits: a delete and a revoke, plus a fresh connection."""
        return 3 * self._config.call_timeout + 1.0

    async def run(self) -> None:
        """Register, keep the lease alive, re-register after any failure; until withdrawn."""
        try:
            # A failure once withdrawing has begun ends the loop: the withdrawal below is what
            # matters then (that last failure is not logged).
            with contextlib.suppress(Exception):
                await self._retrying.run(self._session)
            # Stopped while not connected: the key may still be there from an earlier lease.
            if self._lease is not None:
                await self._withdraw_with_fresh_session()
        finally:
            self._done.set()

    async def _session(self) -> None:
        """One attempt: on the next endpoint, register and keep the lease alive until
        withdrawn (returns) or until etcd fails (raises)."""
        if self._stop.is_set():
            return  # asked to stop during the pause: withdraw in run()
        endpoint = self._config.endpoints[self._attempts % len(self._config.endpoints)]
        self._attempts += 1
        try:
            async with open_session(endpoint, self._config.call_timeout) as session:
                await self._register(session)
                self._retrying.made_progress()
                await self._keep_alive(session)
        except EtcdError:
            raise
        except Exception:
            log.exception("etcd registration failed unexpectedly")
            raise

    def _report_failure(self, error: BaseException, failures: int, pause: float) -> None:
        # A warning when it starts failing; the retries that follow are debug lines.
        level = log.warning if failures == 1 else log.debug
        level(
            "etcd registration failed; still serving, will retry",
            error=str(error) if isinstance(error, EtcdError) else repr(error),
            key=self.key.decode(),
            retry_in_secs=round(pause, 2),
        )

    async def _pause(self, seconds: float) -> None:
        """The backoff pause, cut short by :meth:`withdraw`."""
        with anyio.move_on_after(seconds):
            await self._stop.wait()

    async def withdraw(self) -> None:
        """Delete the key (first), revoke the lease, stop refreshing. Bounded; idempotent.
        A failure is logged: the lease expiry removes the key in the end anyway."""
        self._stop.set()
        with anyio.move_on_after(self.withdraw_bound, shield=True) as scope:
            await self._done.wait()
        if scope.cancelled_caught:
            log.warning("etcd withdrawal did not finish in time", key=self.key.decode())

    async def _register(self, session: EtcdSession) -> None:
        lease = await session.grant(self._config.lease_ttl)
        self._lease = lease
        await session.put(self.key, self._value, lease)
        self.registered.set()
        log.info(
            "registered in etcd",
            key=self.key.decode(),
            etcd=session.endpoint,
            lease_ttl_secs=self._config.lease_ttl,
            role=self.record.role,
        )

    async def _keep_alive(self, session: EtcdSession) -> None:
        assert self._lease is not None
        interval = max(self._config.lease_ttl / 3, _MIN_REFRESH_SECS)
        while True:
            with anyio.move_on_after(interval):
                await self._stop.wait()
            if self._stop.is_set():
                await self._delete(session)
                return
            ttl = await session.keepalive(self._lease)
            if ttl <= 0:
                # etcd was unreachable past the TTL, or lost its data: the key is gone.
                raise EtcdError(f"etcd {session.endpoint}: lease expired; registering again")

    async def _delete(self, session: EtcdSession) -> None:
        # Deleting the key is the step frontends see; revoking only tidies the lease. A failed
        # delete keeps the lease noted, so run() tries again on a fresh session.
        existed = await session.delete(self.key)
        lease, self._lease = self._lease, None
        log.info("withdrawn from etcd", key=self.key.decode(), existed=existed)
        if lease is not None:
            try:
                await session.revoke(lease)
            except EtcdError as err:
                log.info("etcd lease revoke failed; it will expire", error=str(err))

    async def _withdraw_with_fresh_session(self) -> None:
        failure = ""
        for endpoint in self._config.endpoints:
            try:
                async with open_session(endpoint, self._config.call_timeout) as session:
                    await self._delete(session)
                    return
            except EtcdError as err:
                failure = str(err)
        log.warning("etcd withdrawal failed; the key expires with its lease", error=failure)


@asynccontextmanager
async def registered(config: RegistrationConfig, record: WorkerRecord) -> AsyncIterator[Registration]:
    """Keep ``record`` registered while the context is open. Leaving the context withdraws
    (if the caller has not already) and stops the task."""
    registration = Registration(config, record)
    async with anyio.create_task_group() as tg:
        tg.start_soon(registration.run)
        try:
            yield registration
        finally:
            await registration.withdraw()
            tg.cancel_scope.cancel()
