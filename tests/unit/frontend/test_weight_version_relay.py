"""``POST /weight_version`` across ``--processes N`` (sidecar_frontend/membership_relay.py, the
relayed control of sidecar_frontend/admin.py, sidecar_frontend/weight_version_api.py): the
lines between a process and its parent, the parent's record of the version, and several
processes over a parent in one event loop: a version any process takes reaches every process
in the order of the membership changes, the asker answers once its own copy arrived, and a
process started later begins with the last version set."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_frontend.admin import AdminApi, ParentLink, RelayedControl
from sidecar_frontend.config import WorkerSetConfig
from sidecar_frontend.fleet import MAX_WEIGHT_VERSION_BYTES
from sidecar_frontend.membership import AdminError, Membership, Registration
from sidecar_frontend.membership_relay import (
    MAX_UNAPPLIED,
    Apply,
    RelayBook,
    RelayRequest,
    SetVersion,
    VersionApplied,
    VersionDone,
    VersionRequest,
    apply_line,
    parse_control,
    parse_request,
    parse_version_applied,
    parse_version_request,
    refused_line,
    request_line,
    set_version_line,
    version_applied_line,
    version_done_line,
    version_request_line,
)
from sidecar_frontend.processes.child import ControlInbox
from sidecar_frontend.workers import WorkerSet
from tests.unit.frontend.test_membership import FakeSet

# ------------------------------------------------------------------------------ the lines


@pytest.mark.parametrize("version", ["v7", "step-000123", None, "é" * 10])
def test_the_version_lines_read_back(version: str | None) -> None:
    request = VersionRequest(4, version)
    line = version_request_line(request)
    assert line.endswith(b"\n")
    assert b"\n" not in line[:-1]
    assert parse_version_request(line) == request
    for change in (SetVersion(version, 1, 4), SetVersion(version, -1, 0)):
        assert parse_control(set_version_line(change)) == change


def test_the_applied_and_done_lines_read_back() -> None:
    applied = VersionApplied(2, 7)
    assert parse_version_applied(version_applied_line(applied)) == applied
    assert parse_control(version_done_line(VersionDone(7))) == VersionDone(7)
    assert parse_version_request(version_applied_line(applied)) is None


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b'{"event": "version_applied", "id": 1}',
        b'{"event": "version_applied", "origin": 0}',
        b'{"event": "version_applied", "origin": "0", "id": 1}',
        b'{"event": "version_applied", "origin": 0, "id": false}',
        b'{"event": "weight_version", "origin": 0, "id": 1}',
    ],
)
def test_a_line_that_is_no_applied_word_is_none(line: bytes) -> None:
    assert parse_version_applied(line) is None


def test_version_lines_and_membership_lines_are_not_mistaken_for_each_other() -> None:
    version = version_request_line(VersionRequest(1, "v1"))
    membership = request_line(RelayRequest(1, "unregister", "h:1"))
    assert parse_request(version) is None
    assert parse_version_request(membership) is None
    assert not isinstance(parse_control(apply_line(Apply("unregister", "h:1", 0, 1))), SetVersion)


TOO_LONG = "v" * (MAX_WEIGHT_VERSION_BYTES + 1)

NOT_VERSION_REQUESTS = [
    b"",
    b"not json",
    b'{"event": "serving", "metrics_port": 9}',
    b'{"event": "weight_version", "id": 1}',  # no version: not the same as null
    b'{"event": "weight_version", "id": "1", "weight_version": "v1"}',
    b'{"event": "weight_version", "id": true, "weight_version": "v1"}',
    b'{"event": "weight_version", "id": 1, "weight_version": ""}',
    b'{"event": "weight_version", "id": 1, "weight_version": 3}',
    b'{"event": "weight_version", "id": 1, "weight_version": ["v1"]}',
    json.dumps({"event": "weight_version", "id": 1, "weight_version": TOO_LONG}).encode(),
]


@pytest.mark.parametrize("line", NOT_VERSION_REQUESTS)
def test_a_line_that_is_no_version_request_is_none(line: bytes) -> None:
    assert parse_version_request(line) is None


@pytest.mark.parametrize(
    "line",
    [
        b'{"op": "weight_version", "id": 1, "weight_version": "v1"}',  # no origin
        b'{"op": "weight_version", "origin": 0, "weight_version": "v1"}',  # no id
        b'{"op": "weight_version", "origin": 0, "id": 1}',
        b'{"op": "weight_version", "origin": "0", "id": 1, "weight_version": "v1"}',
        b'{"op": "weight_version", "origin": 0, "id": 1, "weight_version": ""}',
        json.dumps({"op": "weight_version", "origin": 0, "id": 1, "weight_version": TOO_LONG}).encode(),
    ],
)
def test_a_version_line_from_the_parent_that_does_not_parse_is_none(line: bytes) -> None:
    assert parse_control(line) is None


# ------------------------------------------------------------------------------ the parent's record


def test_the_parent_records_the_last_version_set_and_never_refuses_one() -> None:
    book = RelayBook()
    assert book.weight_version is None
    assert book.set_version(1, VersionRequest(3, "v2"), [0, 1]) == (SetVersion("v2", 1, 3), None)
    assert book.weight_version == "v2"
    # The same again; and with no serving process to wait for, answered at once.
    assert book.set_version(0, VersionRequest(9, "v2"), []) == (SetVersion("v2", 0, 9), VersionDone(9))
    assert book.set_version(0, VersionRequest(10, None), [0]) == (SetVersion(None, 0, 10), None)
    assert book.weight_version is None, "given back to the workers' reports"
    assert book.registrations() == ()


# (what happens, in turn) to a call of process 0 (its number 5) that waits for processes 0, 1
# and 2: the answer due to the asker after each step, if any.
APPLIED: list[
    tuple[str, list[tuple[str, int, VersionApplied | None]], list[tuple[int, VersionDone] | None]]
] = [
    (
        "each applies it: the last one's word answers",
        [
            ("applied", 1, VersionApplied(0, 5)),
            ("applied", 0, VersionApplied(0, 5)),
            ("applied", 2, VersionApplied(0, 5)),
        ],
        [None, None, (0, VersionDone(5))],
    ),
    (
        "a word said twice counts once",
        [
            ("applied", 1, VersionApplied(0, 5)),
            ("applied", 1, VersionApplied(0, 5)),
            ("applied", 0, VersionApplied(0, 5)),
        ],
        [None, None, None],
    ),
    (
        "another call's word, or a process it does not wait for",
        [
            ("applied", 1, VersionApplied(0, 6)),
            ("applied", 1, VersionApplied(1, 5)),
            ("applied", 3, VersionApplied(0, 5)),
        ],
        [None, None, None],
    ),
    (
        "a process that ends is waited for no more (it starts with the version)",
        [("applied", 0, VersionApplied(0, 5)), ("gone", 2, None), ("applied", 1, VersionApplied(0, 5))],
        [None, None, (0, VersionDone(5))],
    ),
    (
        "the last one it waited for ends",
        [("applied", 0, VersionApplied(0, 5)), ("applied", 1, VersionApplied(0, 5)), ("gone", 2, None)],
        [None, None, (0, VersionDone(5))],
    ),
    (
        "the asker ends: nobody to answer, then or later",
        [("gone", 0, None), ("applied", 1, VersionApplied(0, 5)), ("applied", 2, VersionApplied(0, 5))],
        [None, None, None],
    ),
]


@pytest.mark.parametrize(
    ("steps", "answers"), [(st_, a) for _, st_, a in APPLIED], ids=[name for name, _, _ in APPLIED]
)
def test_the_asker_is_answered_once_every_serving_process_applied_the_version(
    steps: list[tuple[str, int, VersionApplied | None]], answers: list[tuple[int, VersionDone] | None]
) -> None:
    book = RelayBook()
    assert book.set_version(0, VersionRequest(5, "v1"), [0, 1, 2]) == (SetVersion("v1", 0, 5), None)
    seen: list[tuple[int, VersionDone] | None] = []
    for kind, index, applied in steps:
        if kind == "gone":
            due = book.gone(index)
            seen.append(due[0] if due else None)
        else:
            assert applied is not None
            seen.append(book.applied(index, applied))
    assert seen == answers


def test_the_calls_waiting_on_processes_are_bounded() -> None:
    book = RelayBook()
    for number in range(MAX_UNAPPLIED + 10):
        book.set_version(0, VersionRequest(number, "v1"), [1])
    # The oldest were let go: a late word for them answers nothing; the newest are held.
    assert book.applied(1, VersionApplied(0, 0)) is None
    assert book.applied(1, VersionApplied(0, MAX_UNAPPLIED + 9)) == (0, VersionDone(MAX_UNAPPLIED + 9))


# ------------------------------------------------------------------------------ processes over a parent


def _registration(address: str) -> Registration:
    return Registration(f"grpc://{address}/", address, "agg", "sidecar")


class FakeParent:
    """The parent of ``--processes N`` in one event loop, as parent.py relays: a membership
    request decided by a :class:`RelayBook`, a version request recorded there, each change
    written to every process; each process's applied versions recorded in order."""

    def __init__(self, count: int) -> None:
        self.book = RelayBook()
        self.memberships = [Membership(FakeSet(), "static") for _ in range(count)]
        self.applied: list[list[str | None]] = [[] for _ in range(count)]
        self.lines: list[list[bytes]] = [[] for _ in range(count)]
        self.controls = [self.control(i, self.memberships[i], self.applied[i]) for i in range(count)]
        self.held: dict[int, list[bytes]] = {}  # lines for a process that reads none for now
        self.applied_words: list[tuple[int, VersionApplied]] = []  # (by process, word) in order
        self.heard = asyncio.Event()

    def control(self, index: int, membership: Membership, applied: list[str | None]) -> RelayedControl:
        return RelayedControl(
            membership, self.link(index), answer_wait=5.0, apply_weight_version=applied.append
        )

    def link(self, index: int) -> ParentLink:
        def send(line: bytes) -> None:
            version = parse_version_request(line)
            if version is not None:
                change, done = self.book.set_version(index, version, range(len(self.controls)))
                for i in range(len(self.controls)):
                    self.write(i, set_version_line(change))
                if done is not None:
                    self.write(index, version_done_line(done))
                return
            applied = parse_version_applied(line)
            if applied is not None:
                self.applied_words.append((index, applied))
                self.heard.set()
                due = self.book.applied(index, applied)
                if due is not None:
                    self.write(due[0], version_done_line(due[1]))
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
        self.lines[index].append(line)
        if index in self.held:
            self.held[index].append(line)
            return
        # The line arrives later, on the loop, as from a pipe.
        asyncio.get_running_loop().call_soon(self.controls[index].deliver, line)

    def release(self, index: int) -> None:
        """Process ``index`` reads what waited for it, and what comes from now on."""
        for line in self.held.pop(index):
            asyncio.get_running_loop().call_soon(self.controls[index].deliver, line)

    async def said_by(self, index: int, word: VersionApplied) -> None:
        """Until process ``index`` said ``word`` to the parent."""
        while (index, word) not in self.applied_words:
            self.heard.clear()
            await self.heard.wait()

    async def start(self) -> tuple[RelayedControl, list[str | None]]:
        """A process started now, as child.py starts one: the recorded version goes first."""
        inbox = ControlInbox()
        if self.book.weight_version is not None:
            inbox.put(set_version_line(SetVersion(self.book.weight_version, origin=-1, id=0)))
        applied: list[str | None] = []
        link = ParentLink(len(self.controls), lambda line: None, inbox.attach, self.book.registrations())
        control = RelayedControl(Membership(FakeSet(), "static"), link, apply_weight_version=applied.append)
        inbox.attach(control.deliver)
        await asyncio.sleep(0)  # the waiting lines are handed to the loop: one turn
        return control, applied


async def test_a_version_taken_by_one_process_reaches_every_process() -> None:
    parent = FakeParent(3)
    assert await parent.controls[1].set_weight_version("v5") is None
    assert parent.applied == [["v5"], ["v5"], ["v5"]]
    assert await parent.controls[2].set_weight_version(None) is None
    assert parent.applied == [["v5", None]] * 3


async def test_the_asker_answers_only_once_its_own_copy_arrived() -> None:
    parent = FakeParent(2)
    asked = asyncio.ensure_future(parent.controls[0].set_weight_version("v1"))
    await asyncio.sleep(0)  # the request is sent; the parent's line is not yet delivered
    assert parent.applied[0] == []
    assert not asked.done()
    assert await asked is None
    assert parent.applied[0] == ["v1"]


async def test_the_asker_answers_once_every_process_applied_the_version() -> None:
    """A request sent after the answer finds the version in whichever process takes it: the
    answer waits for the process whose copy comes late (its loop busy)."""
    parent = FakeParent(2)
    parent.held[1] = []  # process 1 reads nothing for now
    asked = asyncio.ensure_future(parent.controls[0].set_weight_version("v1"))
    said = asyncio.ensure_future(parent.said_by(0, VersionApplied(0, 1)))
    await asyncio.wait([asked, said], return_when=asyncio.FIRST_COMPLETED, timeout=5)
    assert said.done(), "process 0 applied the version and said so"
    assert parent.applied == [["v1"], []]
    parent.release(1)
    assert await asyncio.wait_for(asked, 5) is None
    assert parent.applied == [["v1"], ["v1"]], "every process holds it when the call answers"


async def test_a_parent_that_does_not_answer_is_a_503() -> None:
    link = ParentLink(0, lambda line: None, lambda handler: None, ())
    applied: list[str | None] = []
    control = RelayedControl(
        Membership(FakeSet(), "static"), link, answer_wait=0.05, apply_weight_version=applied.append
    )
    refused = await control.set_weight_version("v1")
    assert isinstance(refused, AdminError)
    assert (refused.status, refused.code) == (503, "UNAVAILABLE")
    assert applied == []


async def test_a_process_started_later_begins_with_the_version_set() -> None:
    parent = FakeParent(2)
    _, nothing_set = await parent.start()
    assert nothing_set == [], "no version set: the process follows its workers' reports"
    await parent.controls[0].set_weight_version("v9")
    _, applied = await parent.start()
    assert applied == ["v9"]
    await parent.controls[0].set_weight_version(None)
    _, given_back = await parent.start()
    assert given_back == []


CALLS = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.one_of(
            st.tuples(st.just("version"), st.sampled_from(["v1", "v2", "v3", None])),
            st.tuples(st.sampled_from(["register", "unregister"]), st.sampled_from(["a:1", "b:2"])),
        ),
    ),
    max_size=12,
)


@given(CALLS)
@settings(max_examples=100, deadline=None)
def test_every_process_sees_the_same_changes_in_the_parents_order(
    calls: list[tuple[int, tuple[str, Any]]],
) -> None:
    """Whatever the processes are asked, concurrently: every process received the same lines
    in the same order, applied the same versions in that order, ends with the parent's
    version, and a process started now begins with it."""

    async def ask(control: RelayedControl, what: str, value: Any) -> object:
        if what == "version":
            return await control.set_weight_version(cast(str | None, value))
        if what == "register":
            return await control.register(_registration(value))
        return await control.unregister(value)

    async def scenario() -> None:
        parent = FakeParent(3)
        answers = await asyncio.gather(*(ask(parent.controls[i], what, value) for i, (what, value) in calls))
        assert all(a is None for (_, (w, _)), a in zip(calls, answers, strict=True) if w == "version")
        # The lines every process got from the parent (a refusal and a version call's answer
        # go to the asker alone).
        relayed = [
            [ln for ln in lines if json.loads(ln)["op"] not in ("refused", "version_done")]
            for lines in parent.lines
        ]
        assert relayed[0] == relayed[1] == relayed[2]
        assert parent.applied[0] == parent.applied[1] == parent.applied[2]
        versions = [value for _, (what, value) in calls if what == "version"]
        assert sorted(parent.applied[0], key=str) == sorted(versions, key=str)
        expected = parent.applied[0][-1] if parent.applied[0] else None
        assert parent.book.weight_version == expected
        _, started = await parent.start()
        assert started == ([expected] if expected is not None else [])

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ the HTTP side


@asynccontextmanager
async def admin(
    *, parent_answers: bool = True
) -> AsyncIterator[tuple[TestClient[Any, Any], WorkerSet, list[bytes]]]:
    """Process 1 of two, its admin routes as server.py builds them, over a parent that relays
    a version back to it at once (or never answers); the lines it sent the parent."""
    async with WorkerSet(WorkerSetConfig(), rand=random.Random(1)) as workers:
        book, sent = RelayBook(), []
        control: RelayedControl

        def send(line: bytes) -> None:
            sent.append(line)
            if not parent_answers:
                return
            request = parse_version_request(line)
            if request is not None:
                change, _ = book.set_version(1, request, [1])
                asyncio.get_running_loop().call_soon(control.deliver, set_version_line(change))
            applied = parse_version_applied(line)
            if applied is not None and (due := book.applied(1, applied)) is not None:
                asyncio.get_running_loop().call_soon(control.deliver, version_done_line(due[1]))

        link = ParentLink(1, send, lambda handler: None, ())
        membership = Membership(workers, "static")
        control = RelayedControl(
            membership, link, answer_wait=0.05, apply_weight_version=workers.set_weight_version
        )
        application = web.Application()
        application.add_routes(AdminApi(workers, membership, token=None, control=control).routes())
        async with TestClient(TestServer(application)) as client:
            yield client, workers, sent


async def test_a_post_under_processes_goes_through_the_parent_and_says_which_process_answered() -> None:
    async with admin() as (client, workers, sent):
        response = await client.post("/weight_version", json={"weight_version": "v3"})
        assert response.status == 200
        body = await response.json()
        assert (body["weight_version"], body["set_by_admin"], body["process"]) == ("v3", True, 1)
        # The call, then the word that this process applied it (the parent's answer waited for it).
        assert sent == [
            version_request_line(VersionRequest(1, "v3")),
            version_applied_line(VersionApplied(1, 1)),
        ]
        assert workers.registry.versions.newest == "v3"
        response = await client.get("/weight_version")
        body = await response.json()
        assert (body["weight_version"], body["route_latest_weights"], body["process"]) == ("v3", True, 1)
        response = await client.post("/weight_version", json={"weight_version": None})
        assert (await response.json())["set_by_admin"] is False


async def test_a_bad_body_never_reaches_the_parent() -> None:
    async with admin() as (client, _, sent):
        response = await client.post("/weight_version", json={"weight_version": ""})
        assert response.status == 400
        assert sent == []


async def test_a_post_the_parent_does_not_relay_is_a_503_and_changes_nothing() -> None:
    async with admin(parent_answers=False) as (client, workers, sent):
        response = await client.post("/weight_version", json={"weight_version": "v3"})
        assert response.status == 503
        assert (await response.json())["code"] == "UNAVAILABLE"
        assert len(sent) == 1
        assert workers.registry.versions.newest is None
