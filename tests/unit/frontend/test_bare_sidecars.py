"""Bare engines registered through the membership API (sidecar_frontend/bare_sidecars.py and
their side of sidecar_frontend/membership.py): the managed sidecar's command line and
environment, when it is started again, when it is refused, and how the membership holds,
finds and lists a bare engine (by the URL it was registered by, dialled at its sidecar)."""

# The tables hold whole command lines and refusals, one per line.
# ruff: noqa: E501

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_frontend.bare_sidecars import (
    ChildSettings,
    RestartPolicy,
    bare_refusal,
    child_environment,
    sidecar_argv,
)
from sidecar_frontend.membership import Membership, Registration, parse_registration, worker_row
from sidecar_frontend.membership_relay import (
    Apply,
    Refused,
    RelayBook,
    RelayRequest,
    apply_line,
    left_line,
    parse_control,
    parse_left,
    parse_request,
    request_address,
    request_line,
)
from sidecar_frontend.registry import WorkerState
from tests.unit.frontend.test_membership import FakeSet

SETTINGS = ChildSettings("/venv/bin/python", "json", "info")


def _bare(url: str, engine: str = "sglang", role: str = "agg", sidecar: str | None = None) -> Registration:
    address = url.split("://", 1)[1]
    return Registration(url, address, cast(Any, role), cast(Any, engine), None, sidecar)


# ------------------------------------------------------------------------------ the child's command line

ARGV = [
    (
        _bare("http://10.0.0.7:30000"),
        ["/venv/bin/python", "-m", "sidecar_sglang", "--transport", "http", "--http-endpoint", "10.0.0.7:30000", "--listen", "127.0.0.1:41000", "--disaggregation-mode", "agg", "--log-format", "json", "--log-level", "info"],
    ),
    (
        _bare("grpc://10.0.0.7:30001", "sglang", "prefill"),
        ["/venv/bin/python", "-m", "sidecar_sglang", "--grpc-endpoint", "10.0.0.7:30001", "--listen", "127.0.0.1:41000", "--disaggregation-mode", "prefill", "--log-format", "json", "--log-level", "info"],
    ),
    (
        _bare("grpc://[::1]:50051", "vllm", "decode"),
        ["/venv/bin/python", "-m", "sidecar_vllm", "--grpc-endpoint", "[::1]:50051", "--listen", "127.0.0.1:41000", "--disaggregation-mode", "decode", "--log-format", "json", "--log-level", "info"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("registration", "argv"), ARGV)
def test_the_child_runs_the_engines_sidecar_on_loopback(registration: Registration, argv: list[str]) -> None:
    assert sidecar_argv(registration, 41000, SETTINGS) == argv


def test_the_log_format_and_level_pass_through_and_an_ipv6_loopback_is_bracketed() -> None:
    settings_ = ChildSettings("py", "console", "debug", host="::1")
    argv = sidecar_argv(_bare("http://h:1"), 7, settings_)
    assert argv[argv.index("--listen") + 1] == "[::1]:7"
    assert argv[argv.index("--log-format") + 1] == "console"
    assert argv[argv.index("--log-level") + 1] == "debug"


def test_a_sidecar_registration_has_no_child() -> None:
    with pytest.raises(ValueError, match="is a sidecar"):
        sidecar_argv(Registration("grpc://h:1", "h:1", "agg", "sidecar"), 7, SETTINGS)


def test_a_bare_prefill_engines_bootstrap_port_is_not_a_flag() -> None:
    # sidecar-sglang reads the engine's own bootstrap port from the engine (server_info).
    registration = parse_registration(
        b'{"url": "http://h:1", "worker_type": "prefill", "bootstrap_port": 8998}'
    )
    assert isinstance(registration, Registration)
    assert "8998" not in sidecar_argv(registration, 7, SETTINGS)


@given(st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=10), max_size=12))
@settings(max_examples=200, deadline=None)
def test_the_child_inherits_the_environment_but_the_sidecars_flags_and_systemds_socket(
    environ: dict[str, str],
) -> None:
    environ = {
        **environ,
        "SIDECAR_FRONTEND_ADMIN_TOKEN": "secret",
        "SIDECAR_LISTEN": "0.0.0.0:1",
        "NOTIFY_SOCKET": "/run/x",
        "PATH": "/bin",
    }
    kept = child_environment(environ)
    assert {"SIDECAR_FRONTEND_ADMIN_TOKEN", "SIDECAR_LISTEN", "NOTIFY_SOCKET"}.isdisjoint(kept)
    assert kept["PATH"] == "/bin"
    assert kept == {k: v for k, v in environ.items() if not k.startswith("SIDECAR_") and k != "NOTIFY_SOCKET"}


# ------------------------------------------------------------------------------ restarts

POLICY = RestartPolicy(first_delay=0.5, factor=2.0, max_delay=30.0, steady_after=30.0)

DELAYS = [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (100, 30.0), (10_000, 30.0)]


@pytest.mark.parametrize(("exits", "delay"), DELAYS)
def test_the_delay_doubles_with_each_exit_in_a_row_up_to_the_cap(exits: int, delay: float) -> None:
    assert POLICY.delay(exits) == delay


EXITS_IN_A_ROW = [
    (0, 0.1, 1),  # the first exit
    (1, 0.1, 2),  # it failed again at once
    (5, 29.9, 6),
    (5, 30.0, 1),  # it ran steadily: a new failure, the count starts again
    (5, 3600.0, 1),
]


@pytest.mark.parametrize(("before", "ran_for", "after"), EXITS_IN_A_ROW)
def test_a_child_that_ran_steadily_starts_the_count_again(before: int, ran_for: float, after: int) -> None:
    assert POLICY.exits_in_a_row(before, ran_for) == after


@given(st.integers(min_value=1, max_value=10_000))
def test_the_delay_never_shrinks_and_stays_within_bounds(exits: int) -> None:
    assert POLICY.first_delay <= POLICY.delay(exits) <= POLICY.max_delay
    assert POLICY.delay(exits) <= POLICY.delay(exits + 1)


def test_no_delay_before_an_exit() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        POLICY.delay(0)


# ------------------------------------------------------------------------------ refusals

REFUSALS = [
    (False, None),
    (True, "url 'http://h:1' is a bare sglang engine: this frontend dials every worker over TLS (--worker-tls-ca) and the sidecars it runs serve plaintext on loopback; start sidecar-sglang next to the engine and register the sidecar as grpc://HOST:PORT"),
]  # fmt: skip


@pytest.mark.parametrize(("tls", "message"), REFUSALS)
def test_a_bare_engine_is_refused_where_no_child_can_serve_it(tls: bool, message: str | None) -> None:
    refusal = bare_refusal(_bare("http://h:1"), worker_tls=tls)
    if message is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert (refusal.status, refusal.code, refusal.message) == (501, "NOT_IMPLEMENTED", message)


# ------------------------------------------------------------------------------ the membership


def test_a_bare_engine_is_dialled_at_its_sidecar_and_known_by_its_url() -> None:
    workers = FakeSet()
    membership = Membership(workers)
    registration = _bare("http://10.0.0.7:30000", sidecar="127.0.0.1:41000")
    assert membership.register(registration) is None
    assert workers.calls == [("add", "127.0.0.1:41000")]
    ident = str(uuid.uuid5(uuid.NAMESPACE_URL, "http://10.0.0.7:30000"))
    assert registration.id == ident
    for key in (ident, "http://10.0.0.7:30000", "10.0.0.7:30000", "127.0.0.1:41000"):
        assert membership.find(key) == "127.0.0.1:41000", key
    assert membership.find("grpc://10.0.0.7:30001") is None
    row = worker_row(workers.held["127.0.0.1:41000"], membership)
    assert (row["id"], row["url"], row["engine"], row["source"], row["sidecar"]) == (
        ident,
        "http://10.0.0.7:30000",
        "sglang",  # the registration's, until the sidecar reports
        "api",
        "grpc://127.0.0.1:41000",
    )


def test_a_sidecars_row_names_no_managed_sidecar() -> None:
    workers = FakeSet()
    membership = Membership(workers)
    assert membership.register(Registration("grpc://h:1", "h:1", "agg", "sidecar")) is None
    row = worker_row(workers.held["h:1"], membership)
    assert "sidecar" not in row
    assert row["engine"] is None


def test_an_engine_registered_twice_is_refused_before_a_second_sidecar_starts() -> None:
    workers = FakeSet()
    membership = Membership(workers)
    assert membership.register(_bare("http://h:1", sidecar="127.0.0.1:5")) is None
    # The check the API makes before it picks a port and starts a child:
    given_again = parse_registration(b'{"url": "http://h:1/"}')
    assert isinstance(given_again, Registration)
    again = membership.refusal_to_register(given_again)
    assert again is not None
    assert (again.status, again.code) == (409, "WORKER_ALREADY_EXISTS")
    assert membership.refusal_to_register(_bare("http://h:2")) is None


def test_a_removed_bare_engine_registers_again_once_its_worker_left() -> None:
    workers = FakeSet()
    membership = Membership(workers)
    assert membership.register(_bare("http://h:1", sidecar="127.0.0.1:5")) is None
    assert isinstance(membership.unregister("127.0.0.1:5"), str)
    assert workers.held["127.0.0.1:5"].state is WorkerState.DRAINING
    draining = membership.refusal_to_register(_bare("http://h:1"))
    assert draining is not None
    assert (draining.status, draining.code) == (409, "WORKER_DRAINING")
    workers.forget("127.0.0.1:5")
    assert membership.refusal_to_register(_bare("http://h:1")) is None
    assert membership.register(_bare("http://h:1", sidecar="127.0.0.1:6")) is None


def test_a_bare_engine_without_a_sidecar_address_has_no_worker_address() -> None:
    with pytest.raises(ValueError, match="no sidecar address yet"):
        _ = _bare("http://h:1").worker_address


def test_the_relay_carries_a_bare_engines_sidecar_address() -> None:
    registration = _bare("grpc://h:1", "vllm", sidecar="127.0.0.1:5")
    apply = Apply("register", "127.0.0.1:5", 0, 1, registration)
    assert parse_control(apply_line(apply)) == apply
    # Without its sidecar's address a bare engine is not a change a process can apply.
    line = apply_line(Apply("register", "127.0.0.1:5", 0, 1, registration)).replace(
        b'"sidecar_address":"127.0.0.1:5"', b'"sidecar_address":null'
    )
    assert parse_control(line) is None


# ------------------------------------------------------------------------------ under --processes N


def test_a_process_asks_for_a_bare_engine_without_its_sidecars_address() -> None:
    registration = _bare("http://h:1")
    request = RelayRequest(3, "register", request_address(registration), registration)
    assert request.address == "h:1"
    assert parse_request(request_line(request)) == request


def test_the_parent_gives_a_bare_engine_its_sidecars_address_and_refuses_it_twice() -> None:
    book = RelayBook()
    registration = _bare("http://h:1")
    request = RelayRequest(1, "register", "h:1", registration)
    with pytest.raises(ValueError, match="needs its sidecar's address"):
        book.decide(0, request)
    assert book.registrations() == ()
    decided = book.decide(0, request, "127.0.0.1:5")
    held = replace(registration, sidecar_address="127.0.0.1:5")
    assert decided == Apply("register", "127.0.0.1:5", 0, 1, held)
    assert book.registrations() == (held,)
    # The same engine again, from any process: refused before an address is picked for it.
    again = RelayRequest(2, "register", "h:1", _bare("http://h:1"))
    refused = book.refusal(again)
    assert isinstance(refused, Refused)
    assert (refused.id, refused.error.code) == (2, "WORKER_ALREADY_EXISTS")
    assert book.decide(1, RelayRequest(4, "unregister", "127.0.0.1:5")) == Apply(
        "unregister", "127.0.0.1:5", 1, 4
    )
    assert book.refusal(again) is None


def test_a_process_tells_the_parent_a_removed_worker_left() -> None:
    assert parse_left(left_line("127.0.0.1:5")) == "127.0.0.1:5"
    assert parse_left(request_line(RelayRequest(1, "unregister", "127.0.0.1:5"))) is None
    assert parse_left(b"not json") is None
    assert parse_left(b'{"event": "left", "address": 5}') is None
