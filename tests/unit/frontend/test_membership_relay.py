"""The membership API across ``--processes N`` (sidecar_frontend/membership_relay.py and the
relayed control of sidecar_frontend/admin.py): the lines between a process and its parent,
the parent's one list, and several processes over a parent in one event loop: a change any
process takes reaches every process in one order, a refusal reaches the asker alone, and a
process started later holds the list."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_frontend.admin import ParentLink, RelayedControl
from sidecar_frontend.membership import AdminError, Membership, Registration
from sidecar_frontend.membership_relay import (
    Apply,
    Everywhere,
    Refused,
    RelayBook,
    RelayRequest,
    apply_line,
    everywhere_line,
    parse_control,
    parse_left,
    parse_request,
    parse_serving,
    refused_line,
    request_line,
    serving_line,
)
from tests.unit.frontend.test_membership import FakeSet


def _registration(address: str, role: str = "agg") -> Registration:
    return Registration(f"grpc://{address}/", address, cast(Any, role), "sidecar")


# ------------------------------------------------------------------------------ the lines


def test_the_lines_read_back() -> None:
    registration = Registration("grpc://h:1/", "h:1", "prefill", "sidecar")
    for request in (RelayRequest(3, "register", "h:1", registration), RelayRequest(4, "unregister", "h:1")):
        line = request_line(request)
        assert line.endswith(b"\n")
        assert b"\n" not in line[:-1]
        assert parse_request(line) == request
    for message in (
        Apply("register", "h:1", 1, 3, registration),
        Apply("unregister", "h:1", 0, 9),
    ):
        assert parse_control(apply_line(message)) == message
    refused = Refused(5, AdminError(409, "WORKER_ALREADY_EXISTS", "worker grpc://h:1/ is already registered"))
    assert parse_control(refused_line(refused)) == refused
    assert parse_control(everywhere_line(Everywhere("h:1"))) == Everywhere("h:1")
    assert parse_serving(serving_line("h:1")) == "h:1"
    # Each line is one kind only.
    assert parse_left(serving_line("h:1")) is None
    assert parse_request(serving_line("h:1")) is None


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"{}",
        b'{"event": "serving", "metrics_port": 9}',
        b'{"event": "serving", "address": 1}',
        b'{"event": "left", "address": "h:1"}',
    ],
)
def test_a_line_that_is_no_serving_report_is_none(line: bytes) -> None:
    assert parse_serving(line) is None


NOT_MESSAGES = [
    b"",
    b"not json",
    b"[1]",
    b'{"event": "serving", "metrics_port": 9}',
    b'{"event": "admin", "id": 1, "op": "drop", "address": "h:1"}',
    b'{"event": "admin", "id": "1", "op": "unregister", "address": "h:1"}',
    b'{"event": "admin", "id": true, "op": "unregister", "address": "h:1"}',
    b'{"event": "admin", "id": 1, "op": "register", "address": "h:1"}',
    b'{"event": "admin", "id": 1, "op": "register", "address": "h:1", "registration": {"url": "grpc://h:1", '
    b'"address": "h:2", "role": "agg", "engine": "sidecar", "bootstrap_port": null}}',
    b'{"event": "admin", "id": 1, "op": "register", "address": "h:1", "registration": {"url": "grpc://h:1", '
    b'"address": "h:1", "role": "boss", "engine": "sidecar", "bootstrap_port": null}}',
    b'{"event": "admin", "id": 1, "op": "register", "address": "h:1", "registration": {"url": "grpc://h:1", '
    b'"address": "h:1", "role": "agg", "engine": "tgi", "bootstrap_port": null}}',
]


@pytest.mark.parametrize("line", NOT_MESSAGES)
def test_a_line_that_is_no_request_is_none(line: bytes) -> None:
    assert parse_request(line) is None


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"{}",
        b'{"op": "register", "address": "h:1", "origin": 0, "id": 1}',
        b'{"op": "unregister", "address": "h:1", "id": 1}',
        b'{"op": "refused", "id": 1, "status": "409", "code": "X", "message": "m"}',
        b'{"op": "refused", "id": 1, "status": 409, "code": "X"}',
        b'{"op": "everywhere"}',
        b'{"op": "everywhere", "address": ["h:1"]}',
    ],
)
def test_a_line_that_is_no_control_is_none(line: bytes) -> None:
    assert parse_control(line) is None


# ------------------------------------------------------------------------------ the parent's list


def test_the_parent_records_in_order_and_refuses_what_its_list_contradicts() -> None:
    book = RelayBook()
    a, b = _registration("a:1"), _registration("b:2")
    assert book.decide(0, RelayRequest(1, "register", "a:1", a)) == Apply("register", "a:1", 0, 1, a)
    assert book.decide(1, RelayRequest(1, "register", "b:2", b)) == Apply("register", "b:2", 1, 1, b)
    again = book.decide(1, RelayRequest(2, "register", "a:1", _registration("a:1", "decode")))
    assert isinstance(again, Refused)
    assert (again.id, again.error.status, again.error.code) == (2, 409, "WORKER_ALREADY_EXISTS")
    assert book.registrations() == (a, b)
    assert book.decide(0, RelayRequest(7, "unregister", "a:1")) == Apply("unregister", "a:1", 0, 7)
    assert book.decide(0, RelayRequest(8, "unregister", "a:1")) == Refused(
        8, AdminError(404, "WORKER_NOT_FOUND", "no worker a:1")
    )
    assert book.registrations() == (b,)


def _book_with(*addresses: str) -> RelayBook:
    book = RelayBook()
    for number, address in enumerate(addresses):
        assert isinstance(
            book.decide(0, RelayRequest(number, "register", address, _registration(address))), Apply
        )
    return book


# (the process that says so, the worker) in turn, of 3 processes: what the parent sends each time.
SERVING_REPORTS: list[tuple[str, list[tuple[int, str]], list[Everywhere | None]]] = [
    (
        "every process in turn: the last one's report",
        [(0, "a:1"), (1, "a:1"), (2, "a:1")],
        [None, None, Everywhere("a:1")],
    ),
    ("in another order", [(2, "a:1"), (0, "a:1"), (1, "a:1")], [None, None, Everywhere("a:1")]),
    ("a report said twice counts once", [(0, "a:1"), (0, "a:1"), (1, "a:1")], [None, None, None]),
    (
        "each worker on its own",
        [(0, "a:1"), (1, "b:2"), (1, "a:1"), (2, "a:1")],
        [None, None, None, Everywhere("a:1")],
    ),
    ("an unregistered worker", [(0, "c:3"), (1, "c:3"), (2, "c:3")], [None, None, None]),
    ("no such process", [(0, "a:1"), (1, "a:1"), (3, "a:1"), (-1, "a:1")], [None, None, None, None]),
    (
        "after every process said so, again",
        [(0, "a:1"), (1, "a:1"), (2, "a:1"), (2, "a:1")],
        [None, None, Everywhere("a:1"), None],
    ),
]


@pytest.mark.parametrize(
    ("reports", "sent"), [(r, s) for _, r, s in SERVING_REPORTS], ids=[name for name, _, _ in SERVING_REPORTS]
)
def test_the_parent_says_a_worker_serves_everywhere_once_every_process_said_so(
    reports: list[tuple[int, str]], sent: list[Everywhere | None]
) -> None:
    book = _book_with("a:1", "b:2")
    assert [book.serving(index, address, 3) for index, address in reports] == sent


def test_a_process_that_ended_says_it_again_and_a_new_registration_starts_anew() -> None:
    book = _book_with("a:1")
    assert book.serving(0, "a:1", 2) is None
    book.gone(0)  # restarted: its next run has not served the worker yet
    assert book.serving(1, "a:1", 2) is None
    assert book.serving(0, "a:1", 2) == Everywhere("a:1")
    # Removed and registered again: what was said of the old registration does not count.
    assert isinstance(book.decide(1, RelayRequest(5, "unregister", "a:1")), Apply)
    assert book.serving(0, "a:1", 2) is None
    assert isinstance(book.decide(1, RelayRequest(6, "register", "a:1", _registration("a:1"))), Apply)
    assert book.serving(1, "a:1", 2) is None
    assert book.serving(0, "a:1", 2) == Everywhere("a:1")


# ------------------------------------------------------------------------------ processes over a parent


class FakeParent:
    """The parent of ``--processes N`` in one event loop: each process's line is decided by a
    :class:`RelayBook` and its answer written to the processes, as parent.py does."""

    def __init__(self, count: int, *, mute: bool = False) -> None:
        self.book = RelayBook()
        self.mute = mute
        self.sets = [FakeSet() for _ in range(count)]
        self.memberships = [Membership(s, "static") for s in self.sets]
        self.controls = [
            RelayedControl(m, self.link(i), answer_wait=0.5) for i, m in enumerate(self.memberships)
        ]
        self.inboxes: list[list[bytes]] = [[] for _ in range(count)]

    def link(self, index: int) -> ParentLink:
        def send(line: bytes) -> None:
            if self.mute:
                return
            request = parse_request(line)
            assert request is not None
            decision = self.book.decide(index, request)
            if isinstance(decision, Apply):
                for i in range(len(self.controls)):
                    self.write(i, apply_line(decision))
            else:
                self.write(index, refused_line(decision))

        return ParentLink(index, send, lambda handler: None, ())

    def write(self, index: int, line: bytes) -> None:
        self.inboxes[index].append(line)
        # The line arrives later, on the loop, as from a pipe.
        asyncio.get_running_loop().call_soon(self.controls[index].deliver, line)


async def test_a_registration_taken_by_one_process_reaches_every_process() -> None:
    parent = FakeParent(3)
    registration = _registration("a:1")
    assert await parent.controls[1].register(registration) is None
    for membership, fake in zip(parent.memberships, parent.sets, strict=True):
        assert membership.registered() == {"a:1": registration}
        assert membership.source_of("a:1") == "api"
        assert "a:1" in fake.held
    # Every process now knows it: another process refuses a second registration itself.
    again = await parent.controls[2].register(_registration("a:1", "decode"))
    assert isinstance(again, AdminError)
    assert again.code == "WORKER_ALREADY_EXISTS"
    assert len(parent.inboxes[2]) == 1, "refused in the process, the parent was not asked"
    outcome = await parent.controls[0].unregister("a:1")
    assert outcome == "worker grpc://a:1/ is draining: requests in flight there finish, then it leaves"
    for membership, fake in zip(parent.memberships, parent.sets, strict=True):
        assert membership.registered() == {}
        assert fake.calls[-1] == ("drain", "a:1")


async def test_a_refusal_from_the_parent_reaches_the_asker_alone() -> None:
    parent = FakeParent(2)
    # Both processes ask at once for the same worker: the parent records the first, refuses
    # the second (neither process had it when it asked).
    first, second = await asyncio.gather(
        parent.controls[0].register(_registration("a:1")),
        parent.controls[1].register(_registration("a:1", "decode")),
    )
    assert first is None
    assert isinstance(second, AdminError)
    assert second.code == "WORKER_ALREADY_EXISTS"
    assert [json.loads(line)["op"] for line in parent.inboxes[0]] == ["register"]
    assert [json.loads(line)["op"] for line in parent.inboxes[1]] == ["register", "refused"]
    for membership in parent.memberships:
        assert membership.registered()["a:1"].role == "agg"


@given(
    st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.sampled_from(["a:1", "b:2", "c:3"])), max_size=12)
)
@settings(max_examples=100, deadline=None)
def test_every_process_ends_with_the_parents_list(calls: list[tuple[int, bool, str]]) -> None:
    """Whatever the processes are asked, concurrently: every process's registrations are the
    parent's list, and a process started now from that list holds the same."""

    async def scenario() -> None:
        parent = FakeParent(3)
        await asyncio.gather(
            *(
                parent.controls[index].register(_registration(address))
                if register
                else parent.controls[index].unregister(address)
                for index, register, address in calls
            )
        )
        await asyncio.sleep(0)  # the last lines delivered
        expected = {r.address: r for r in parent.book.registrations()}
        for membership in parent.memberships:
            assert dict(membership.registered()) == expected
        late = Membership(FakeSet(), "static")
        for registration in parent.book.registrations():
            late.adopt(registration)
        assert dict(late.registered()) == expected

    asyncio.run(scenario())


async def test_a_parent_that_does_not_answer_is_a_503() -> None:
    parent = FakeParent(1, mute=True)
    refused = await parent.controls[0].register(_registration("a:1"))
    assert isinstance(refused, AdminError)
    assert (refused.status, refused.code) == (503, "UNAVAILABLE")
    assert parent.memberships[0].registered() == {}


def test_a_worker_still_draining_comes_back_once_it_left() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    registration = _registration("a:1")
    membership.register(registration)
    membership.unregister("a:1")
    # The parent registered it again for every process while this one still drains it.
    membership.adopt(registration)
    assert fake.held["a:1"].state.value == "draining"
    assert membership.missing() == []
    fake.forget("a:1")
    assert membership.missing() == [registration]
