"""Per-tenant rate limits: the file's format (every key, every error), and the token buckets
(a minute's burst, both-or-neither, settle, truthful Retry-After, reconfigure keeps levels, the
table of buckets stays bounded); the bound a client relies on is checked over random runs."""

from __future__ import annotations

import copy
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_frontend.admission import rates as rates_module
from sidecar_frontend.admission.rates import (
    DEFAULT_TENANT,
    UNLIMITED,
    Grant,
    RateConfig,
    RateConfigError,
    RateLimiter,
    RateRefusal,
    TenantRate,
    parse_rate_config,
)

SOURCE = "/etc/limits.toml"

EXAMPLE = """
[default]
requests_per_minute = 600
tokens_per_minute = 200000
[tenants."team-a"]
requests_per_minute = 6000
[tenants."batch"]
tokens_per_minute = 50000
"""


def limiter(requests: float | None = None, tokens: float | None = None, **tenants: TenantRate) -> RateLimiter:
    return RateLimiter(RateConfig(default=TenantRate(requests, tokens), tenants=tenants))


def granted(outcome: Grant | RateRefusal) -> Grant:
    assert isinstance(outcome, Grant), outcome
    return outcome


def refused(outcome: Grant | RateRefusal) -> RateRefusal:
    assert isinstance(outcome, RateRefusal), outcome
    return outcome


# ---- the file -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", RateConfig(default=UNLIMITED, tenants={})),
        (
            EXAMPLE,
            RateConfig(
                default=TenantRate(600, 200000),
                tenants={"team-a": TenantRate(6000, 200000), "batch": TenantRate(600, 50000)},
            ),
        ),
        ("[default]\nrequests_per_minute = 1.5\n", RateConfig(TenantRate(1.5, None), {})),
        ("[default]\ntokens_per_minute = 0\n", RateConfig(TenantRate(None, 0), {})),
        ("[default]\nrequests_per_minute = 0\n", RateConfig(TenantRate(0, None), {})),
        ("[default]\nrequests_per_minute = 1\n", RateConfig(TenantRate(1, None), {})),
        # inf: no limit, for the default or (against a limited default) for one tenant.
        ("[default]\ntokens_per_minute = inf\n", RateConfig(UNLIMITED, {})),
        (
            '[default]\ntokens_per_minute = 100\n[tenants."t"]\ntokens_per_minute = +inf\n',
            RateConfig(TenantRate(None, 100), {"t": UNLIMITED}),
        ),
        # No [default]: unlimited, and so is what a tenant leaves out.
        ('[tenants."t"]\nrequests_per_minute = 5\n', RateConfig(UNLIMITED, {"t": TenantRate(5, None)})),
        # An empty tenant table: the default's limits, listed.
        (
            '[default]\nrequests_per_minute = 5\n[tenants."t"]\n',
            RateConfig(TenantRate(5, None), {"t": TenantRate(5, None)}),
        ),
        # Bare and dotted keys are the same TOML.
        ("tenants.alpha.tokens_per_minute = 7\n", RateConfig(UNLIMITED, {"alpha": TenantRate(None, 7)})),
        ("[tenants]\n", RateConfig(UNLIMITED, {})),
    ],
)
def test_parse(text: str, expected: RateConfig) -> None:
    assert parse_rate_config(text, SOURCE) == expected


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[default\n", ["not valid TOML"]),
        ("limit = 5\n", ["limit", "unknown"]),
        ("[limits]\nrequests_per_minute = 5\n", ["limits", "unknown"]),
        ("default = 5\n", ["[default]", "must be a table"]),
        ("[default]\nrpm = 5\n", ["[default]", "unknown key rpm"]),
        ("[default]\nrequests_per_minute = -1\n", ["[default] requests_per_minute", "at least 0", "-1"]),
        ("[default]\ntokens_per_minute = -0.5\n", ["[default] tokens_per_minute", "at least 0"]),
        ('[default]\ntokens_per_minute = "600"\n', ["[default] tokens_per_minute", "a number", "'600'"]),
        ("[default]\ntokens_per_minute = true\n", ["[default] tokens_per_minute", "a number", "True"]),
        ("[default]\ntokens_per_minute = [1]\n", ["[default] tokens_per_minute", "a number"]),
        ("[default]\ntokens_per_minute = nan\n", ["[default] tokens_per_minute", "nan"]),
        ("[default]\ntokens_per_minute = -inf\n", ["[default] tokens_per_minute", "at least 0"]),
        ("[default]\nrequests_per_minute = 0.5\n", ["[default] requests_per_minute", "0 or at least 1"]),
        ("[default.extra]\nrequests_per_minute = 5\n", ["[default]", "unknown key extra"]),
        ("tenants = 5\n", ["tenants", "[tenants.NAME]"]),
        ("[tenants]\nteam = 5\n", ['[tenants."team"]', "must be a table"]),
        ('[tenants."a"]\ntokens_per_minute = -5\n', ['[tenants."a"] tokens_per_minute', "at least 0"]),
        ('[tenants."a"]\nburst = 5\n', ['[tenants."a"]', "unknown key burst"]),
        ('[tenants.""]\nrequests_per_minute = 5\n', ['[tenants.""]', "[default]"]),
    ],
)
def test_parse_errors(text: str, fragments: list[str]) -> None:
    with pytest.raises(RateConfigError) as caught:
        parse_rate_config(text, SOURCE)
    message = str(caught.value)
    assert message.startswith(f"{SOURCE}: ")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("requests", "tokens"),
    [(-1.0, None), (None, -1.0), (0.5, None), (float("nan"), None), (None, float("inf"))],
)
def test_tenant_rate_refuses_values_no_bucket_can_have(requests: float | None, tokens: float | None) -> None:
    with pytest.raises(ValueError, match="per_minute"):
        TenantRate(requests, tokens)


def test_the_documented_examples_parse() -> None:
    expected = RateConfig(
        default=TenantRate(600, 200000),
        tenants={"team-a": TenantRate(6000, 200000), "batch": TenantRate(None, 50000)},
    )
    docs = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Rate limits file") :]
    example = section[section.index("```toml") + len("```toml") : section.index("```\n", 10)]
    assert parse_rate_config(example, "docs") == expected
    docstring = rates_module.__doc__ or ""
    example = docstring[docstring.index("    [default]") : docstring.index("Both keys")]
    assert parse_rate_config(textwrap.dedent(example), "docstring") == expected


def test_rate_of_a_tenant() -> None:
    config = parse_rate_config(EXAMPLE, SOURCE)
    assert config.rate_of("team-a") == TenantRate(6000, 200000)
    assert config.rate_of("nobody") == config.default
    assert config.rate_of(DEFAULT_TENANT) == config.default


# ---- the buckets --------------------------------------------------------------------------


def test_a_new_tenant_has_a_minutes_burst_then_waits_for_the_refill() -> None:
    rates = limiter(requests=3)
    for _ in range(3):
        granted(rates.take("t", 0, now=0.0))
    refusal = refused(rates.take("t", 0, now=0.0))
    assert refusal.retry_after == 20  # one request every 20 s
    assert "3 requests per minute" in refusal.detail
    assert 'tenant "t"' in refusal.detail
    refused(rates.take("t", 0, now=19.0))
    granted(rates.take("t", 0, now=20.0))


def test_tokens_refill_continuously() -> None:
    rates = limiter(tokens=600)  # 10 a second
    granted(rates.take("t", 600, now=0.0))
    refusal = refused(rates.take("t", 100, now=0.0))
    assert refusal.retry_after == 10
    assert "600 tokens per minute" in refusal.detail
    assert refused(rates.take("t", 1, now=0.0)).retry_after == 1  # 0.1 s, in whole seconds
    granted(rates.take("t", 50, now=5.0))
    refused(rates.take("t", 1, now=5.0))


def test_a_request_takes_both_or_neither() -> None:
    # Refused for its tokens: its request stays in the bucket.
    rates = limiter(requests=2, tokens=100)
    granted(rates.take("t", 100, now=0.0))
    refused(rates.take("t", 50, now=0.0))
    granted(rates.take("t", 0, now=0.0))
    refused(rates.take("t", 0, now=0.0))
    # Refused for its request: its tokens stay in the bucket.
    rates = limiter(requests=2, tokens=60)  # a request every 30 s, a token a second
    granted(rates.take("t", 0, now=0.0))
    granted(rates.take("t", 0, now=0.0))
    assert refused(rates.take("t", 60, now=0.0)).retry_after == 30
    granted(rates.take("t", 60, now=30.0))


def test_the_refusal_names_every_bucket_short_and_waits_for_the_slowest() -> None:
    rates = limiter(requests=1, tokens=60)
    granted(rates.take("t", 60, now=0.0))
    refusal = refused(rates.take("t", 30, now=10.0))
    assert refusal.retry_after == 50  # the request bucket: 60 s after the first; tokens: 20 s
    assert "1 requests per minute and 60 tokens per minute" in refusal.detail


@pytest.mark.parametrize(
    ("requests", "tokens", "take", "words"),
    [
        (None, 100, 101, ["101 tokens", "100 tokens per minute", "never be admitted"]),
        (None, 0, 1, ["1 tokens", "0 tokens per minute", "never be admitted"]),
        (0, None, 0, ["no requests"]),
    ],
)
def test_a_request_no_bucket_can_hold_is_refused_for_good(
    requests: float | None, tokens: float | None, take: int, words: list[str]
) -> None:
    rates = limiter(requests, tokens)
    for now in (0.0, 3600.0):
        refusal = refused(rates.take("t", take, now=now))
        assert refusal.retry_after == 60
        for word in words:
            assert word in refusal.detail


def test_zero_tokens_at_a_zero_token_rate_pass() -> None:
    granted(limiter(tokens=0).take("t", 0, now=0.0))


def test_settle_gives_back_what_the_estimate_took_beyond_the_usage() -> None:
    rates = limiter(tokens=100)
    grant = granted(rates.take("t", 100, now=0.0))
    assert grant == Grant("t", 100)
    rates.settle(grant, 40, now=0.0)
    granted(rates.take("t", 60, now=0.0))
    refused(rates.take("t", 1, now=0.0))


def test_settle_gives_back_no_more_than_a_full_bucket() -> None:
    rates = limiter(tokens=100)
    grant = granted(rates.take("t", 50, now=0.0))
    rates.settle(grant, 0, now=59.0)  # full again by then
    granted(rates.take("t", 100, now=59.0))
    refused(rates.take("t", 1, now=59.0))


def test_an_idle_tenants_burst_is_still_one_minutes_worth() -> None:
    rates = limiter(requests=60, tokens=600)
    granted(rates.take("t", 1, now=0.0))
    granted(rates.take("t", 600, now=59.5))
    refused(rates.take("t", 1, now=59.5))
    for _ in range(60):
        granted(rates.take("u", 0, now=0.0))
    refused(rates.take("u", 0, now=0.0))
    for _ in range(60):
        granted(rates.take("u", 0, now=3600.0))
    refused(rates.take("u", 0, now=3600.0))


def test_settle_charges_usage_beyond_the_estimate() -> None:
    rates = limiter(tokens=60)  # a token a second
    grant = granted(rates.take("t", 10, now=0.0))
    rates.settle(grant, 70, now=0.0)  # 10 below empty
    assert refused(rates.take("t", 0, now=0.0)).retry_after == 10
    granted(rates.take("t", 0, now=10.0))


def test_settle_of_an_unlimited_kind_changes_nothing() -> None:
    rates = limiter(requests=1)
    grant = granted(rates.take("t", 10**9, now=0.0))
    rates.settle(grant, 0, now=0.0)
    rates.settle(grant, 10**12, now=0.0)
    granted(rates.take("t", 10**9, now=60.0))


def test_no_limit_admits_everything_and_holds_no_bucket() -> None:
    rates = RateLimiter(RateConfig(default=UNLIMITED, tenants={}))
    for now in range(100):
        granted(rates.take(f"t{now}", 10**9, now=float(now)))
    assert rates.tracked_buckets == 0


def test_tenants_have_their_own_buckets_and_unlisted_ones_the_default() -> None:
    rates = RateLimiter(parse_rate_config(EXAMPLE, SOURCE))
    granted(rates.take("batch", 50000, now=0.0))
    refused(rates.take("batch", 1, now=0.0))
    granted(rates.take("team-a", 200000, now=0.0))
    granted(rates.take("other", 200000, now=0.0))
    granted(rates.take(DEFAULT_TENANT, 200000, now=0.0))
    # The default tenant and an unlisted one share the default's limits, not its bucket.
    refusal = refused(rates.take(DEFAULT_TENANT, 1, now=0.0))
    assert "the default tenant" in refusal.detail
    for _ in range(600):
        granted(rates.take("team-b", 0, now=0.0))
    refused(rates.take("team-b", 0, now=0.0))
    for _ in range(600):
        granted(rates.take("team-a", 0, now=0.0))


def test_negative_tokens_are_a_caller_bug() -> None:
    rates = limiter(tokens=100)
    with pytest.raises(ValueError, match="negative"):
        rates.take("t", -1, now=0.0)
    grant = granted(rates.take("t", 1, now=0.0))
    with pytest.raises(ValueError, match="negative"):
        rates.settle(grant, -1, now=0.0)


def test_a_clock_that_goes_back_neither_refills_nor_drains() -> None:
    rates = limiter(tokens=60)
    granted(rates.take("t", 30, now=100.0))
    granted(rates.take("t", 30, now=50.0))
    refused(rates.take("t", 1, now=50.0))
    granted(rates.take("t", 1, now=101.0))


def test_idle_tenants_buckets_are_dropped() -> None:
    rates = limiter(requests=60, tokens=6000)
    for tenant in range(1000):
        granted(rates.take(f"t{tenant}", 6000, now=0.0))
    debtor = granted(rates.take("debtor", 6000, now=0.0))
    rates.settle(debtor, 6000 * 3, now=0.0)  # two minutes below empty
    granted(rates.take("recent", 6000, now=30.0))  # half full at 60
    assert rates.tracked_buckets == 2004
    granted(rates.take("new", 1, now=60.0))  # every other bucket is full by now
    # The debtor's tokens, the recent tenant's tokens, and the new tenant's two.
    assert rates.tracked_buckets == 1 + 1 + 2
    refused(rates.take("recent", 3001, now=60.0))
    # A dropped bucket admits as a full one did.
    granted(rates.take("t0", 6000, now=60.0))
    refused(rates.take("t0", 1, now=60.0))
    refused(rates.take("debtor", 0, now=60.0))


# ---- reconfigure --------------------------------------------------------------------------


def test_reconfigure_keeps_a_bucket_level() -> None:
    rates = limiter(tokens=100)
    granted(rates.take("t", 80, now=0.0))
    rates.reconfigure(RateConfig(TenantRate(None, 1000), {}), now=0.0)
    refused(rates.take("t", 21, now=0.0))
    granted(rates.take("t", 20, now=0.0))
    assert rates.config == RateConfig(TenantRate(None, 1000), {})


def test_reconfigure_caps_a_level_to_the_new_size() -> None:
    rates = limiter(tokens=100)
    granted(rates.take("t", 10, now=0.0))
    rates.reconfigure(RateConfig(TenantRate(None, 50), {}), now=0.0)
    granted(rates.take("t", 50, now=0.0))
    refused(rates.take("t", 1, now=0.0))


def test_reconfigure_refills_at_the_old_rate_until_now() -> None:
    rates = limiter(tokens=60)
    granted(rates.take("t", 60, now=0.0))
    rates.reconfigure(RateConfig(TenantRate(None, 6000), {}), now=30.0)
    granted(rates.take("t", 30, now=30.0))
    assert refused(rates.take("t", 1, now=30.0)).retry_after == 1  # at the new rate


def test_reconfigure_to_and_from_no_limit() -> None:
    rates = limiter(tokens=100)
    granted(rates.take("t", 100, now=0.0))
    rates.reconfigure(RateConfig(UNLIMITED, {}), now=0.0)
    granted(rates.take("t", 10**6, now=0.0))
    assert rates.tracked_buckets == 0
    rates.reconfigure(RateConfig(TenantRate(None, 100), {}), now=0.0)
    granted(rates.take("t", 100, now=0.0))  # a newly limited kind starts full


def test_reconfigure_keeps_a_full_bucket_full() -> None:
    rates = limiter(tokens=100)
    granted(rates.take("t", 100, now=0.0))
    granted(rates.take("u", 1, now=0.0))
    rates.reconfigure(RateConfig(TenantRate(None, 1000), {}), now=60.0)  # both full by now
    for tenant in ("t", "u", "new"):
        granted(rates.take(tenant, 1000, now=60.0))


def test_reconfigure_moves_a_tenant_to_its_own_limits() -> None:
    rates = limiter(tokens=100)
    granted(rates.take("t", 100, now=0.0))
    rates.reconfigure(RateConfig(TenantRate(None, 100), {"t": TenantRate(None, 1000)}), now=0.0)
    refused(rates.take("t", 1, now=0.0))  # the level it had, under its own rate
    granted(rates.take("t", 100, now=6.0))


# ---- properties over random runs ----------------------------------------------------------


@dataclass(frozen=True)
class Take:
    after: float
    tokens: int


@dataclass(frozen=True)
class Settle:
    after: float
    grant: int  # which earlier grant (modulo their number)
    actual: int


operations = st.lists(
    st.one_of(
        st.builds(Take, st.floats(0, 20), st.integers(0, 400)),
        st.builds(Settle, st.floats(0, 20), st.integers(0, 1000), st.integers(0, 600)),
    ),
    max_size=60,
)
rates_per_minute = st.one_of(st.none(), st.floats(1, 600), st.integers(1, 600).map(float))


@settings(max_examples=300, deadline=None)
@given(requests=rates_per_minute, tokens=rates_per_minute, ops=operations)
def test_what_a_window_admits_never_exceeds_a_full_bucket_and_its_refill(
    requests: float | None, tokens: float | None, ops: list[Take | Settle]
) -> None:
    rates = limiter(requests, tokens)
    now = 0.0
    # (when, requests admitted, tokens admitted minus tokens given back)
    events: list[tuple[float, int, int]] = []
    grants: list[Grant] = []
    settled: set[int] = set()
    for op in ops:
        now += op.after
        if isinstance(op, Take):
            outcome = rates.take("t", op.tokens, now)
            if isinstance(outcome, Grant):
                grants.append(outcome)
                events.append((now, 1, op.tokens))
        elif grants:
            index = op.grant % len(grants)
            if index in settled:
                continue
            settled.add(index)
            rates.settle(grants[index], op.actual, now)
            # A settle that charges more is not admission: it only delays the next one.
            events.append((now, 0, -max(0, grants[index].tokens - op.actual)))
    for first in range(len(events)):
        admitted_requests = admitted_tokens = 0
        for last in range(first, len(events)):
            admitted_requests += events[last][1]
            admitted_tokens += events[last][2]
            window = events[last][0] - events[first][0]
            for per_minute, admitted in ((requests, admitted_requests), (tokens, admitted_tokens)):
                if per_minute is not None:
                    bound = per_minute + per_minute / 60 * window
                    assert admitted <= bound * (1 + 1e-6) + 1e-6


@settings(max_examples=300, deadline=None)
@given(
    requests=rates_per_minute,
    tokens=rates_per_minute,
    ops=operations,
    probe=st.integers(0, 600),
    after=st.floats(0, 20),
)
def test_retry_after_is_truthful(
    requests: float | None, tokens: float | None, ops: list[Take | Settle], probe: int, after: float
) -> None:
    rates = limiter(requests, tokens)
    now = 0.0
    grants: list[Grant] = []
    for op in ops:
        now += op.after
        if isinstance(op, Take):
            outcome = rates.take("t", op.tokens, now)
            if isinstance(outcome, Grant):
                grants.append(outcome)
        elif grants:
            rates.settle(grants[op.grant % len(grants)], op.actual, now)
    now += after
    outcome = rates.take("t", probe, now)
    if isinstance(outcome, Grant):
        return
    assert outcome.retry_after >= 1
    if tokens is not None and probe > tokens:
        assert outcome.retry_after == 60
        assert "never be admitted" in outcome.detail
        return
    assert isinstance(rates.take("t", probe, now + outcome.retry_after), Grant)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.integers(1, 1000).map(lambda per_second: per_second * 60.0),
    new_tokens=st.integers(1, 1000).map(lambda per_second: per_second * 60.0),
    takes=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 60000)), max_size=20),
    probes=st.lists(st.integers(0, 60000), min_size=1, max_size=10),
)
def test_reconfigure_keeps_every_level_capped_to_the_new_size_and_full_ones_full(
    tokens: float, new_tokens: float, takes: list[tuple[int, int]], probes: list[int]
) -> None:
    # Whole seconds at whole tokens a second: every level is a whole number, exactly.
    rates = limiter(tokens=tokens)
    now = 0.0
    for after, take in takes:
        now += after
        rates.take("t", take, now)
    reconfigured = copy.deepcopy(rates)
    reconfigured.reconfigure(RateConfig(TenantRate(None, new_tokens), {}), now)
    # A full bucket stays full, at its new size (a full one and a dropped one are the same).
    full = isinstance(copy.deepcopy(rates).take("t", int(tokens), now), Grant)
    for probe in probes:
        before = isinstance(copy.deepcopy(rates).take("t", probe, now), Grant)
        after = isinstance(copy.deepcopy(reconfigured).take("t", probe, now), Grant)
        assert after == ((before or full) and probe <= new_tokens)
