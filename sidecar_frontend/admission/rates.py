"""Per-tenant rate limits: requests and tokens per minute, as token buckets (pure: no I/O, no
clock, no logging; the time is passed in as ``now``, in seconds).

Each tenant has up to two buckets, one for requests and one for tokens. A bucket holds one
minute's worth of its rate (a tenant idle for a minute may send a minute's worth at once) and
refills continuously at that rate. A request needs one request and its estimated tokens (its
prompt plus its ``max_tokens``, as the caller counts them); it takes both or neither. Once the
request has finished, :meth:`RateLimiter.settle` gives back what the estimate took beyond the
real usage (or charges what the usage took beyond the estimate: the bucket may then go below
empty, and the tenant waits until it refills). A refused request is told when its bucket will
hold enough (``retry_after``, whole seconds, for the HTTP ``Retry-After``); a request larger
than a whole bucket can never be admitted and is told so.

The limits come from a TOML file (read by :mod:`sidecar_frontend.admission.rate_file`)::

    [default]                       # every tenant not listed below, and requests without one
    requests_per_minute = 600
    tokens_per_minute = 200000

    [tenants."team-a"]              # team-a: more requests, the default's tokens per minute
    requests_per_minute = 6000

    [tenants."batch"]
    tokens_per_minute = 50000
    requests_per_minute = inf       # inf: no limit on this kind for this tenant

Both keys are optional everywhere. A key missing from ``[default]`` (or a file without
``[default]``) means no limit; a key missing from a tenant's table means the default's value.
Values are numbers (integers or floats) at least 0; ``requests_per_minute`` is 0 (no request
admitted) or at least 1 (a bucket of a minute's worth must hold one request). Unknown tables or
keys, other value types, negative values, ``nan`` and a ``[tenants.""]`` table (the tenant ""
is the default) are refused with a :class:`RateConfigError` naming the file, table and key.
"""

from __future__ import annotations

import enum
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sidecar_frontend.admission.who import DEFAULT_TENANT

__all__ = [
    "DEFAULT_TENANT",
    "UNLIMITED",
    "Grant",
    "RateConfig",
    "RateConfigError",
    "RateLimiter",
    "RateRefusal",
    "TenantRate",
    "parse_rate_config",
]

# The tenant of a request that names none; it always has the default rates.

# A bucket is full after this many seconds at its rate (a minute's worth: the burst).
_BUCKET_SECONDS: Final = 60.0

# The Retry-After of a request no bucket will ever hold: as long as a bucket takes to fill, by
# which time the limits may have been raised.
_NEVER_RETRY_AFTER: Final = 60

# A take succeeds when a bucket holds its need short of this fraction of its capacity: the
# floating point refill must not make a retry at exactly ``retry_after`` fall a hair short.
_SLACK: Final = 1e-6


@dataclass(frozen=True)
class TenantRate:
    """A tenant's limits, per minute; None: no limit on that kind."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number at least 0 or None, not {value!r}")
        if self.requests_per_minute is not None and 0 < self.requests_per_minute < 1:
            raise ValueError(f"requests_per_minute must be 0 or at least 1, not {self.requests_per_minute!r}")


UNLIMITED: Final = TenantRate()


@dataclass(frozen=True)
class RateConfig:
    """The limits of every tenant: ``tenants`` by name, ``default`` for every other one (and
    for :data:`DEFAULT_TENANT`). A listed tenant's rates are complete (the parser filled in
    the default's where its table left a key out)."""

    default: TenantRate
    tenants: Mapping[str, TenantRate]

    def rate_of(self, tenant: str) -> TenantRate:
        """The limits that apply to ``tenant``."""
        if tenant == DEFAULT_TENANT:
            return self.default
        return self.tenants.get(tenant, self.default)


class RateConfigError(ValueError):
    """A rate limits file that cannot be used; the message names the file, the table and
    the key."""


_KEYS: Final = ("requests_per_minute", "tokens_per_minute")


def _tenant_table(name: str) -> str:
    return f"[tenants.{json.dumps(name)}]"


def _read_value(value: object, key: str, where: str) -> float | None:
    """A limit's value: a finite number at least 0, or None for ``inf`` (no limit)."""
    # bool is an int to Python, but `true` is no rate.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RateConfigError(f"{where} {key}: must be a number, not {value!r}")
    if math.isnan(value):
        raise RateConfigError(f"{where} {key}: must be a number, not nan")
    if value < 0:
        raise RateConfigError(f"{where} {key}: must be at least 0, not {value!r}")
    if math.isinf(value):
        return None
    if key == "requests_per_minute" and 0 < value < 1:
        raise RateConfigError(
            f"{where} {key}: must be 0 or at least 1, not {value!r} (a bucket holds one minute's worth)"
        )
    return float(value)


def _read_table(table: object, where: str, base: TenantRate) -> TenantRate:
    """One table's limits, the keys it leaves out taken from ``base``."""
    if not isinstance(table, dict):
        raise RateConfigError(f"{where}: must be a table of {' and '.join(_KEYS)}, not {table!r}")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise RateConfigError(f"{where}: unknown key {', '.join(unknown)} (known: {', '.join(_KEYS)})")
    requests = base.requests_per_minute
    if "requests_per_minute" in table:
        requests = _read_value(table["requests_per_minute"], "requests_per_minute", where)
    tokens = base.tokens_per_minute
    if "tokens_per_minute" in table:
        tokens = _read_value(table["tokens_per_minute"], "tokens_per_minute", where)
    return TenantRate(requests_per_minute=requests, tokens_per_minute=tokens)


def parse_rate_config(text: str, source: str) -> RateConfig:
    """The limits in ``text``, a TOML document (format: the module's docstring). ``source``
    names it in errors (the file's path)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RateConfigError(f"{source}: not valid TOML: {err}") from None
    unknown = sorted(set(document) - {"default", "tenants"})
    if unknown:
        raise RateConfigError(
            f"{source}: unknown table or key {', '.join(unknown)} (known: [default], [tenants.NAME])"
        )
    default = _read_table(document.get("default", {}), f"{source}: [default]", UNLIMITED)
    tenants_table = document.get("tenants", {})
    if not isinstance(tenants_table, dict):
        raise RateConfigError(f"{source}: tenants: must be tables [tenants.NAME], not {tenants_table!r}")
    tenants: dict[str, TenantRate] = {}
    for name, table in tenants_table.items():
        where = f"{source}: {_tenant_table(name)}"
        if name == DEFAULT_TENANT:
            raise RateConfigError(f'{where}: the tenant "" is the default; set its limits in [default]')
        tenants[name] = _read_table(table, where, default)
    return RateConfig(default=default, tenants=tenants)


@dataclass(frozen=True)
class Grant:
    """What an admitted request took: its tenant and its estimated tokens (to settle later)."""

    tenant: str
    tokens: int


@dataclass(frozen=True)
class RateRefusal:
    """A refused request: in whole seconds (at least 1), when the bucket will hold enough if
    nothing else takes from it; and why, in words for the client."""

    retry_after: int
    detail: str


class _Kind(enum.Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


def _per_minute(rate: TenantRate, kind: _Kind) -> float | None:
    return rate.requests_per_minute if kind is _Kind.REQUESTS else rate.tokens_per_minute


@dataclass
class _Bucket:
    """A bucket's level at ``updated_at`` (may be below 0 after a settle charged more)."""

    level: float
    updated_at: float

    def refill(self, per_minute: float, now: float) -> None:
        # A clock that went back refills nothing (and does not drain).
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(per_minute, self.level + per_minute / _BUCKET_SECONDS * elapsed)
        self.updated_at = max(self.updated_at, now)


def _tenant_words(tenant: str) -> str:
    return "the default tenant" if tenant == DEFAULT_TENANT else f"tenant {json.dumps(tenant)}"


def _format_rate(per_minute: float) -> str:
    return f"{per_minute:g}"


class RateLimiter:
    """The buckets of every tenant under one :class:`RateConfig`.

    A bucket appears (full) at a tenant's first request and is dropped once it has refilled
    to full: a full bucket and no bucket admit the same, so the table holds only the tenants
    that were busy within about the last minute or two (or that are still paying off a settle
    that charged more than the estimate).
    """

    def __init__(self, config: RateConfig) -> None:
        self._config = config
        self._buckets: dict[tuple[str, _Kind], _Bucket] = {}
        self._swept_at: float | None = None

    @property
    def config(self) -> RateConfig:
        return self._config

    @property
    def tracked_buckets(self) -> int:
        """How many buckets are held (the rest are full)."""
        return len(self._buckets)

    def reconfigure(self, config: RateConfig, now: float) -> None:
        """Apply new limits. Each bucket keeps its level (refilled at the old rate up to
        ``now``), capped at its new size. A full bucket stays full (at its new size): a
        tenant's bucket that is full and one that was dropped for being full must not differ.
        A kind that is no longer limited loses its bucket, and one that becomes limited starts
        full."""
        for (tenant, kind), bucket in list(self._buckets.items()):
            old = _per_minute(self._config.rate_of(tenant), kind)
            new = _per_minute(config.rate_of(tenant), kind)
            if old is not None:
                bucket.refill(old, now)
            if new is None or old is None or bucket.level >= old:
                del self._buckets[(tenant, kind)]
            else:
                bucket.level = min(bucket.level, new)
                bucket.updated_at = max(bucket.updated_at, now)
        self._config = config

    def take(self, tenant: str, tokens: int, now: float) -> Grant | RateRefusal:
        """Admit one request of ``tokens`` estimated tokens for ``tenant``, taking one request
        and its tokens from the tenant's buckets, or refuse it and take nothing."""
        if tokens < 0:
            raise ValueError(f"a request's tokens cannot be negative: {tokens}")
        self._sweep(now)
        rate = self._config.rate_of(tenant)
        needs = ((_Kind.REQUESTS, 1), (_Kind.TOKENS, tokens))
        wait = 0.0
        short: list[str] = []
        for kind, need in needs:
            per_minute = _per_minute(rate, kind)
            if per_minute is None:
                continue
            if need > per_minute or (per_minute == 0 and need > 0):
                return RateRefusal(
                    _NEVER_RETRY_AFTER,
                    self._never_detail(tenant, kind, need, per_minute),
                )
            bucket = self._bucket(tenant, kind, per_minute, now)
            if bucket.level >= need - _SLACK * per_minute:
                continue
            if per_minute == 0:
                # Below empty at a rate of 0 (a settle charged it): it never refills.
                return RateRefusal(_NEVER_RETRY_AFTER, self._never_detail(tenant, kind, need, per_minute))
            wait = max(wait, (need - bucket.level) / (per_minute / _BUCKET_SECONDS))
            short.append(f"{_format_rate(per_minute)} {kind.value} per minute")
        if short:
            return RateRefusal(
                max(1, math.ceil(wait)),
                f"rate limit of {_tenant_words(tenant)} reached: {' and '.join(short)}",
            )
        for kind, need in needs:
            per_minute = _per_minute(rate, kind)
            if per_minute is not None:
                self._bucket(tenant, kind, per_minute, now).level -= need
        return Grant(tenant=tenant, tokens=tokens)

    def settle(self, grant: Grant, actual_tokens: int, now: float) -> None:
        """The request of ``grant`` used ``actual_tokens``: give back what its estimate took
        beyond that (up to a full bucket), or take what it used beyond the estimate."""
        if actual_tokens < 0:
            raise ValueError(f"a request's tokens cannot be negative: {actual_tokens}")
        per_minute = self._config.rate_of(grant.tenant).tokens_per_minute
        if per_minute is None or actual_tokens == grant.tokens:
            return
        bucket = self._bucket(grant.tenant, _Kind.TOKENS, per_minute, now)
        bucket.level = min(per_minute, bucket.level + grant.tokens - actual_tokens)

    def _bucket(self, tenant: str, kind: _Kind, per_minute: float, now: float) -> _Bucket:
        """The bucket refilled up to ``now`` (a new one is full)."""
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = self._buckets[(tenant, kind)] = _Bucket(level=per_minute, updated_at=now)
        else:
            bucket.refill(per_minute, now)
        return bucket

    def _sweep(self, now: float) -> None:
        """Once per bucket-filling time, drop the buckets that have refilled to full."""
        if self._swept_at is not None and now - self._swept_at < _BUCKET_SECONDS:
            return
        self._swept_at = now
        for (tenant, kind), bucket in list(self._buckets.items()):
            per_minute = _per_minute(self._config.rate_of(tenant), kind)
            if per_minute is None:
                del self._buckets[(tenant, kind)]
                continue
            bucket.refill(per_minute, now)
            if bucket.level >= per_minute:
                del self._buckets[(tenant, kind)]

    @staticmethod
    def _never_detail(tenant: str, kind: _Kind, need: int, per_minute: float) -> str:
        if kind is _Kind.REQUESTS:
            return f"{_tenant_words(tenant)} may send no requests (requests_per_minute is 0)"
        return (
            f"this request's estimated {need} tokens (prompt plus max_tokens) exceed the "
            f"{_format_rate(per_minute)} tokens per minute of {_tenant_words(tenant)}: it can never "
            "be admitted; shorten the prompt or lower max_tokens"
        )
