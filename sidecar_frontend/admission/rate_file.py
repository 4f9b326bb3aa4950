"""The rate limits file (``--rate-limits FILE``): read at startup, then followed.

:func:`load_rate_file` reads it once; at startup a missing or bad file raises a
:class:`~sidecar_frontend.admission.rates.RateConfigError` naming it. :func:`follow_rate_file`
then looks at the file every ``interval`` seconds (one ``stat``: its inode, size and
modification time) and, when it changed, re-reads it and gives the new limits to the
:class:`~sidecar_frontend.admission.rates.RateLimiter` (``rate limits reloaded``, with the
number of tenants). A file that became bad or went missing leaves the limits as they were and
logs one warning per change of the file, so an operator's typo costs no limit and no log flood.
The format: :mod:`sidecar_frontend.admission.rates`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final

import anyio
import structlog

from sidecar_frontend.admission.rates import RateConfig, RateConfigError, RateLimiter, parse_rate_config

__all__ = ["RateFileFollower", "follow_rate_file", "load_rate_file"]

log = structlog.get_logger("sidecar_frontend.rates")

# What tells a rewrite or a replacement of the file (stat follows a symlink, so a Kubernetes
# ConfigMap's swap of its link is a new inode); None: the file is missing.
_Signature = tuple[int, int, int, int] | None

# A follower that has not looked yet: its first look re-reads whatever is there.
_UNSEEN: Final = (-1, -1, -1, -1)


def load_rate_file(path: str) -> RateConfig:
    """The limits in the file at ``path``; RateConfigError (naming it) when it is missing,
    unreadable or bad."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise RateConfigError(f"{path}: no such rate limits file") from None
    except OSError as err:
        raise RateConfigError(f"{path}: cannot be read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RateConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return parse_rate_config(text, path)


def _signature(path: str) -> _Signature:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class RateFileFollower:
    """One look at the rate limits file per :meth:`check` (what :func:`follow_rate_file`
    runs every interval)."""

    def __init__(
        self, path: str, limiter: RateLimiter, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.limiter = limiter
        self._clock = clock
        self._signature: _Signature = _UNSEEN

    def check(self) -> bool:
        """Re-read the file if it changed since the last look; True when new limits were
        applied. The first look reads the file whatever its state, and applies it only when it
        differs from the limiter's limits (the file may have changed since it was loaded)."""
        first = self._signature == _UNSEEN
        # Taken before the read: a write that lands during the read changes the file again
        # after this signature, so the next look reads it.
        signature = _signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            config = load_rate_file(self.path)
        except RateConfigError as err:
            log.warning(
                "rate limits file not applied; the previous limits stay", path=self.path, error=str(err)
            )
            return False
        if first and config == self.limiter.config:
            return False
        self.limiter.reconfigure(config, self._clock())
        log.info("rate limits reloaded", path=self.path, tenants=len(config.tenants))
        return True


async def follow_rate_file(
    path: str,
    limiter: RateLimiter,
    *,
    interval: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Give ``limiter`` the limits of the file at ``path`` each time it changes; runs until
    cancelled."""
    follower = RateFileFollower(path, limiter, clock=clock)
    while True:
        follower.check()
        await anyio.sleep(interval)
