"""The membership API's decisions (sidecar_frontend/membership.py): registration bodies and
their refusals word for word, worker ids, who may call, which source lists which worker, and
the rows GET /workers answers."""

# The tables hold whole refusals, one per line.
# ruff: noqa: E501

from __future__ import annotations

import json
import uuid
from typing import Any, cast

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.membership import (
    AdminError,
    Membership,
    Registration,
    admin_access,
    canonical_url,
    is_loopback,
    parse_registration,
    parse_worker_url,
    worker_id,
    worker_list,
    worker_row,
)
from sidecar_frontend.registry import Refusal, Worker, WorkerState


def _worker(address: str, role: str = "agg") -> Worker:
    return Worker(address, cast(Any, role), cast(Any, None), cast(Any, None))


class FakeSet:
    """The worker set as Membership sees it: a drained worker stays (DRAINING) until
    :meth:`forget`, as the real set keeps it until its requests finished."""

    def __init__(self) -> None:
        self.held: dict[str, Worker] = {}
        self.calls: list[tuple[str, str]] = []

    def add_worker(self, address: str, role: str = "agg") -> None:
        self.calls.append(("add", address))
        self.held.setdefault(address, _worker(address, role))

    def drain_worker(self, address: str) -> None:
        self.calls.append(("drain", address))
        worker = self.held.get(address)
        if worker is not None:
            worker.state = WorkerState.DRAINING

    def forget(self, address: str) -> None:
        del self.held[address]

    def addresses(self) -> frozenset[str]:
        return frozenset(self.held)

    def next_change(self) -> anyio.Event:
        return anyio.Event()

    def get(self, address: str) -> Worker | None:
        return self.held.get(address)


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


# ------------------------------------------------------------------------------ bodies

ACCEPTED = [
    (
        _body(url="grpc://10.0.0.1:50051"),
        Registration("grpc://10.0.0.1:50051", "10.0.0.1:50051", "agg", "sidecar"),
    ),
    (_body(url="grpc://h:1/"), Registration("grpc://h:1/", "h:1", "agg", "sidecar")),
    (_body(url=" grpc://h:1 "), Registration("grpc://h:1", "h:1", "agg", "sidecar")),
    (_body(url="GRPC://h:1"), Registration("GRPC://h:1", "h:1", "agg", "sidecar")),
    (
        _body(url="grpc://[::1]:9", worker_type="prefill"),
        Registration("grpc://[::1]:9", "[::1]:9", "prefill", "sidecar"),
    ),
    (
        _body(url="grpc://h:1", worker_type="decode", engine="sidecar"),
        Registration("grpc://h:1", "h:1", "decode", "sidecar"),
    ),
    (
        _body(url="grpc://h:1", worker_type=None, engine=None, bootstrap_port=None),
        Registration("grpc://h:1", "h:1", "agg", "sidecar"),
    ),
    # Bare engines: the frontend runs their sidecar (its address is picked later).
    (_body(url="http://h:1"), Registration("http://h:1", "h:1", "agg", "sglang")),
    (_body(url="http://h:1", engine="sglang"), Registration("http://h:1", "h:1", "agg", "sglang")),
    (_body(url="grpc://h:1", engine="sglang"), Registration("grpc://h:1", "h:1", "agg", "sglang")),
    (_body(url="grpc://h:1", engine="vllm"), Registration("grpc://h:1", "h:1", "agg", "vllm")),
    (
        _body(url="http://h:1", worker_type="prefill", bootstrap_port=8998),
        Registration("http://h:1", "h:1", "prefill", "sglang", 8998),
    ),
]


@pytest.mark.parametrize(("body", "expected"), ACCEPTED)
def test_a_body_is_a_registration(body: bytes, expected: Registration) -> None:
    assert parse_registration(body) == expected


REFUSED = [
    (b"", 400, "the body must be a JSON object with at least url, got null"),
    (b"{", 400, "the body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (b"[1]", 400, "the body must be a JSON object with at least url, got an array"),
    (b'"grpc://h:1"', 400, "the body must be a JSON object with at least url, got a string"),
    (_body(), 400, "url is required: grpc://HOST:PORT for a sidecar"),
    (_body(url=5), 400, "url must be a string, got a number"),
    (_body(url="grpc://h:1", priority=3), 400, "unsupported field priority: this frontend takes url, worker_type, bootstrap_port, engine"),
    (_body(url="grpc://h:1", labels={}, cost=1), 400, "unsupported fields cost, labels: this frontend takes url, worker_type, bootstrap_port, engine"),
    (_body(url="h:1"), 400, "url 'h:1': expected grpc://HOST:PORT (a sidecar) or http://HOST:PORT (a bare engine)"),
    (_body(url="ipc:///tmp/x"), 400, "url 'ipc:///tmp/x': expected grpc://HOST:PORT (a sidecar) or http://HOST:PORT (a bare engine)"),
    (_body(url="grpcs://h:1"), 400, "url 'grpcs://h:1': the frontend dials workers over TLS when it has --worker-tls-ca, whatever the URL says; give the worker as grpc://HOST:PORT"),
    (_body(url="https://h:1"), 400, "url 'https://h:1': the frontend dials workers over TLS when it has --worker-tls-ca, whatever the URL says; give the worker as http://HOST:PORT"),
    (_body(url="grpc://h:1/generate"), 400, "url 'grpc://h:1/generate': expected only grpc://HOST:PORT (no user, path or query)"),
    (_body(url="grpc://h:1?x=1"), 400, "url 'grpc://h:1?x=1': expected only grpc://HOST:PORT (no user, path or query)"),
    (_body(url="grpc://u@h:1"), 400, "url 'grpc://u@h:1': expected only grpc://HOST:PORT (no user, path or query)"),
    (_body(url="grpc://h"), 400, "url 'grpc://h' is not SCHEME://HOST:PORT"),
    (_body(url="grpc://h:0"), 400, "url 'grpc://h:0': the port is not between 1 and 65535"),
    (_body(url="grpc://h:x"), 400, "url 'grpc://h:x': the port is not a number"),
    (_body(url="grpc://::1:5"), 400, "url 'grpc://::1:5': an IPv6 address goes in brackets, as grpc://[::1]:50051"),
    (_body(url="grpc://h:1", worker_type="encode"), 400, "worker_type must be one of regular, prefill, decode, got 'encode'"),
    (_body(url="grpc://h:1", worker_type=1), 400, "worker_type must be one of regular, prefill, decode, got 'a number'"),
    (_body(url="grpc://h:1", engine="trtllm"), 400, "engine must be one of sidecar, sglang, vllm, got 'trtllm'"),
    (_body(url="http://h:1", engine="sidecar"), 400, "url 'http://h:1': a sidecar is reached over gRPC, as grpc://HOST:PORT"),
    (_body(url="grpc://h:1", worker_type="prefill", bootstrap_port="8998"), 400, "bootstrap_port must be a whole number, got a string"),
    (_body(url="grpc://h:1", worker_type="prefill", bootstrap_port=True), 400, "bootstrap_port must be a whole number, got a boolean"),
    (_body(url="grpc://h:1", worker_type="prefill", bootstrap_port=70000), 400, "bootstrap_port must be between 1 and 65535, got 70000"),
    (_body(url="http://h:1", bootstrap_port=8998), 400, "bootstrap_port is a prefill server's: only with worker_type prefill"),
    (_body(url="grpc://h:1", worker_type="prefill", bootstrap_port=8998), 400, "bootstrap_port: a sidecar learns its engine's bootstrap port from the engine itself; leave it out for a grpc:// URL"),
    (_body(url="http://h:1", engine="vllm"), 400, "url 'http://h:1' is vLLM's HTTP server, which no sidecar here speaks: start vLLM's gRPC server (vllm serve MODEL --grpc) and register grpc://HOST:PORT with engine vllm, or run sidecar-vllm beside it and register the sidecar"),
    (_body(url="grpc://h:1", engine="vllm", worker_type="prefill", bootstrap_port=8998), 400, "bootstrap_port is an SGLang prefill server's; leave it out for engine vllm"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "message"), REFUSED)
def test_a_refused_body_says_why(body: bytes, status: int, message: str) -> None:
    refusal = parse_registration(body)
    assert isinstance(refusal, AdminError)
    assert (refusal.status, refusal.message) == (status, message)
    assert refusal.code == "BAD_REQUEST"
    assert json.loads(refusal.json_body()) == {"error": message, "code": refusal.code}


@given(
    st.dictionaries(
        st.text(max_size=12), st.one_of(st.none(), st.integers(), st.text(max_size=20)), max_size=5
    )
)
@settings(max_examples=300, deadline=None)
def test_any_object_is_a_registration_or_a_refusal(data: dict[str, object]) -> None:
    got = parse_registration(json.dumps(data).encode())
    if isinstance(got, Registration):
        assert got.engine == (data.get("engine") or ("sglang" if got.scheme == "http" else "sidecar"))
        assert got.sidecar_address is None
        assert set(data) <= {"url", "worker_type", "bootstrap_port", "engine"}
    else:
        assert got.status == 400


# ------------------------------------------------------------------------------ ids


def test_ids_are_name_based_uuids_of_the_canonical_url() -> None:
    first = worker_id("grpc://10.0.0.1:50051")
    assert uuid.UUID(first).version == 5
    assert first == worker_id("grpc://10.0.0.1:50051")
    assert first != worker_id("grpc://10.0.0.1:50052")
    assert first != worker_id("http://10.0.0.1:50051")
    # The form a caller wrote does not change it: the id is made from the address.
    a = parse_registration(_body(url="GRPC://10.0.0.1:50051/"))
    b = parse_registration(_body(url="grpc://10.0.0.1:50051"))
    assert isinstance(a, Registration)
    assert isinstance(b, Registration)
    assert a.id == b.id == first
    assert canonical_url("grpc", "10.0.0.1:50051") == "grpc://10.0.0.1:50051"


def test_a_url_is_read_to_the_address_the_worker_set_dials() -> None:
    parsed = parse_worker_url("grpc://[2001:db8::1]:50051")
    assert not isinstance(parsed, AdminError)
    assert (parsed.scheme, parsed.address) == ("grpc", "[2001:db8::1]:50051")


# ------------------------------------------------------------------------------ who may call

TOKEN = "s3cret"

ACCESS = [
    # (token, Authorization header, peer) -> status (None: allowed)
    (None, None, "127.0.0.1", None),
    (None, None, "127.9.9.9", None),
    (None, None, "::1", None),
    (None, None, "::ffff:127.0.0.1", None),
    (None, "Bearer anything", "127.0.0.1", None),
    (None, None, "10.0.0.5", 403),
    (None, "Bearer s3cret", "10.0.0.5", 403),
    (None, None, "::ffff:10.0.0.5", 403),
    (None, None, None, 403),
    (None, None, "not-an-address", 403),
    (TOKEN, "Bearer s3cret", "10.0.0.5", None),
    (TOKEN, "bearer s3cret", "10.0.0.5", None),
    (TOKEN, "Bearer  s3cret ", "10.0.0.5", None),
    (TOKEN, "Bearer s3cret", "127.0.0.1", None),
    (TOKEN, None, "127.0.0.1", 401),
    (TOKEN, None, "10.0.0.5", 401),
    (TOKEN, "Bearer", "10.0.0.5", 401),
    (TOKEN, "Bearer wrong", "10.0.0.5", 401),
    (TOKEN, "Bearer s3cret2", "10.0.0.5", 401),
    (TOKEN, "Basic s3cret", "10.0.0.5", 401),
    (TOKEN, "s3cret", "10.0.0.5", 401),
]


@pytest.mark.parametrize(("token", "authorization", "peer", "status"), ACCESS)
def test_who_may_call(
    token: str | None, authorization: str | None, peer: str | None, status: int | None
) -> None:
    refusal = admin_access(token, authorization, peer)
    assert (refusal.status if refusal is not None else None) == status


def test_the_refusals_say_what_to_do() -> None:
    forbidden = admin_access(None, None, "10.0.0.5")
    assert forbidden is not None
    assert forbidden.code == "FORBIDDEN"
    assert "only from this host's loopback" in forbidden.message
    assert "--admin-token (SIDECAR_FRONTEND_ADMIN_TOKEN)" in forbidden.message
    missing = admin_access(TOKEN, None, "10.0.0.5")
    assert missing is not None
    assert missing.message == "admin calls need the header Authorization: Bearer <admin token>"
    wrong = admin_access(TOKEN, "Bearer nope", "10.0.0.5")
    assert wrong is not None
    assert wrong.message == "the bearer token is not this frontend's admin token"
    assert TOKEN not in wrong.message


def test_loopback_is_read_from_the_peer_address() -> None:
    assert is_loopback("::1%lo")
    assert not is_loopback("")
    assert not is_loopback("0.0.0.0")


# ------------------------------------------------------------------------------ who lists what


def _registration(address: str, role: str = "agg") -> Registration:
    return Registration(f"grpc://{address}", address, cast(Any, role), "sidecar")


def test_a_registered_worker_joins_and_leaves_by_the_api() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    assert membership.register(_registration("a:1")) is None
    assert fake.calls == [("add", "a:1")]
    assert membership.source_of("a:1") == "api"
    assert (
        membership.unregister("a:1")
        == "worker grpc://a:1 is draining: requests in flight there finish, then it leaves"
    )
    assert fake.calls[-1] == ("drain", "a:1")
    assert membership.registered() == {}


def test_discovery_cannot_drain_a_registered_worker() -> None:
    fake = FakeSet()
    membership = Membership(fake, "dns")
    membership.register(_registration("a:1"))
    # DNS later lists the same address, then drops it: the API's worker stays.
    membership.add_worker("a:1")
    membership.drain_worker("a:1")
    assert ("drain", "a:1") not in fake.calls
    assert fake.held["a:1"].state is WorkerState.CONNECTING
    # Its removal through the API drains it (discovery no longer lists it).
    assert isinstance(membership.unregister("a:1"), str)
    assert fake.calls[-1] == ("drain", "a:1")


def test_a_worker_both_sources_list_stays_until_both_let_go() -> None:
    fake = FakeSet()
    membership = Membership(fake, "etcd")
    membership.register(_registration("a:1"))
    membership.add_worker("a:1")  # etcd lists it too
    outcome = membership.unregister("a:1")
    assert (
        outcome
        == "worker grpc://a:1 is no longer registered through the API; it stays, as --discovery etcd lists it too"
    )
    assert ("drain", "a:1") not in fake.calls
    assert membership.source_of("a:1") == "etcd"
    membership.drain_worker("a:1")
    assert fake.calls[-1] == ("drain", "a:1")


def test_the_api_cannot_take_or_remove_a_discovered_worker() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    membership.add_worker("a:1", "prefill")
    refused = membership.register(_registration("a:1"))
    assert refused == AdminError(
        409,
        "WORKER_FROM_DISCOVERY",
        "worker a:1 is already listed by --discovery static; it cannot also be registered through the API",
    )
    assert membership.unregister("a:1") == AdminError(
        409,
        "WORKER_FROM_DISCOVERY",
        "worker a:1 was listed by --discovery static, not registered through the API: it leaves when "
        "discovery stops listing it",
    )
    assert membership.unregister("b:2") == AdminError(404, "WORKER_NOT_FOUND", "no worker b:2")
    assert fake.calls == [("add", "a:1")]


def test_a_removed_worker_is_listed_as_the_apis_while_it_drains() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    registration = Registration("grpc://a:1/", "a:1", "agg", "sidecar")
    membership.register(registration)
    membership.unregister("a:1")
    assert (membership.source_of("a:1"), membership.url_of("a:1")) == ("api", "grpc://a:1/")
    assert membership.find("grpc://a:1/") == "a:1"
    assert membership.unregister("a:1") == AdminError(
        409,
        "WORKER_DRAINING",
        "worker grpc://a:1/ is already draining: it leaves once the requests in flight there finish",
    )
    fake.forget("a:1")
    assert membership.find("grpc://a:1/") is None
    assert membership.unregister("a:1") == AdminError(404, "WORKER_NOT_FOUND", "no worker a:1")


def test_a_second_registration_and_one_while_draining_are_conflicts() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    first = _registration("a:1")
    membership.register(first)
    again = membership.register(_registration("a:1", "decode"))
    assert again == AdminError(
        409,
        "WORKER_ALREADY_EXISTS",
        f"worker grpc://a:1 is already registered with id {first.id}; DELETE /workers/{first.id} first to "
        "register it again",
    )
    membership.unregister("a:1")
    draining = membership.register(first)
    assert draining is not None
    assert draining.code == "WORKER_DRAINING"
    fake.forget("a:1")
    assert membership.register(first) is None


def test_a_worker_is_found_by_id_url_or_address() -> None:
    fake = FakeSet()
    membership = Membership(fake, "dns")
    registration = Registration("grpc://a:1/", "a:1", "agg", "sidecar")
    membership.register(registration)
    membership.add_worker("b:2")
    for key in (registration.id, "grpc://a:1/", "grpc://a:1", "a:1", "GRPC://a:1"):
        assert membership.find(key) == "a:1", key
    for key in (worker_id("grpc://b:2"), "grpc://b:2", "b:2"):
        assert membership.find(key) == "b:2", key
    assert membership.find("c:3") is None
    assert membership.find(str(uuid.uuid4())) is None
    assert membership.url_of("a:1") == "grpc://a:1/"
    assert membership.url_of("b:2") == "grpc://b:2"


OPS = st.lists(
    st.tuples(st.sampled_from(["register", "unregister", "discover", "undiscover", "forget"]), st.sampled_from(["a:1", "b:2"])),
    max_size=30,
)  # fmt: skip


@given(OPS)
@settings(max_examples=400, deadline=None)
def test_a_worker_is_held_while_a_source_lists_it(ops: list[tuple[str, str]]) -> None:
    """Whatever the two sources do, in any order: a worker the API registered is held and
    never drained while it stays registered; one discovery lists is held; and a worker no
    source lists any more was drained."""
    fake = FakeSet()
    membership = Membership(fake, "dns")
    api: set[str] = set()
    discovered: set[str] = set()
    for op, address in ops:
        if op == "register":
            if membership.register(_registration(address)) is None:
                api.add(address)
        elif op == "unregister":
            if not isinstance(membership.unregister(address), AdminError):
                api.discard(address)
        elif op == "discover":
            membership.add_worker(address)
            discovered.add(address)
        elif op == "undiscover":
            membership.drain_worker(address)
            discovered.discard(address)
        elif address in fake.held and fake.held[address].state is WorkerState.DRAINING:
            fake.forget(address)  # its requests finished
            # Discovery's reconcile adds again what it lists and the set no longer holds (the
            # set ignored the add while it drained the address).
            for name in discovered - fake.addresses():
                membership.add_worker(name)
        assert set(membership.registered()) == api
        for name in api:
            assert fake.held[name].state is not WorkerState.DRAINING, (name, ops)
        for name in discovered:
            # Draining only when discovery listed it again while the API's removal drained it;
            # it is back once forgotten (above).
            assert name in fake.held, (name, ops)
        for name, worker in fake.held.items():
            if name not in api | discovered:
                assert worker.state is WorkerState.DRAINING, (name, ops)


# ------------------------------------------------------------------------------ GET /workers


def test_a_row_shows_state_model_load_and_source() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    membership.register(_registration("a:1", "prefill"))
    worker = fake.held["a:1"]
    worker.state = WorkerState.SERVING
    worker.model = sidecar_pb2.ModelInfo(served_model_name="m", engine="vllm")
    worker.inflight = 3
    worker.reported_inflight, worker.own_at_report = 5, 1
    worker.running_requests, worker.waiting_requests, worker.kv_usage = 6, 1, 0.25
    assert worker_row(worker, membership) == {
        "id": worker_id("grpc://a:1"),
        "url": "grpc://a:1",
        "worker_type": "prefill",
        "state": "serving",
        "is_healthy": True,
        "ejected": False,
        "model": "m",
        "model_id": "m",
        "engine": "vllm",
        "weight_version": None,
        "load": 7,
        "running_requests": 6,
        "waiting_requests": 1,
        "kv_usage": 0.25,
        "source": "api",
    }


def test_the_list_counts_types_and_filters_by_model() -> None:
    fake = FakeSet()
    membership = Membership(fake, "static")
    membership.add_worker("a:1")
    membership.add_worker("b:2", "decode")
    fake.held["b:2"].model = sidecar_pb2.ModelInfo(served_model_name="m")
    refused = fake.held["a:1"]
    refused.state, refused.refusal, refused.refusal_message = WorkerState.REFUSED, Refusal.MODEL, "serves 'x'"
    listed = worker_list(fake.held.values(), membership)
    assert listed["total"] == 2
    assert listed["stats"] == {"regular_count": 1, "prefill_count": 0, "decode_count": 1}
    rows = cast(list[dict[str, object]], listed["workers"])
    assert rows[0]["refusal"] == "serves 'x'"
    assert rows[0]["source"] == "static"
    only = worker_list(fake.held.values(), membership, model="m")
    assert [row["url"] for row in cast(list[dict[str, object]], only["workers"])] == ["grpc://b:2"]
