"""Discovery's pure views: what DNS answers and etcd events turn into (add, drain), flag
parsing, and a property: applying the changes to a worker set always yields the view."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.disaggregation import Role
from sidecar_common.registration_record import RecordError, WorkerRecord, encode_record
from sidecar_frontend.discovery_records import (
    AddWorker,
    Change,
    DnsTarget,
    DnsView,
    DrainWorker,
    EtcdView,
    Rejected,
    diff_workers,
    missing_workers,
    parse_dns_target,
    parse_worker,
)


def rec(address: str, role: Role = "agg") -> bytes:
    return encode_record(WorkerRecord(address, "vllm", "m", role))


@pytest.mark.parametrize(
    ("old", "new", "changes"),
    [
        ({}, {}, []),
        ({}, {"b:1": "agg", "a:1": "prefill"}, [AddWorker("a:1", "prefill"), AddWorker("b:1", "agg")]),
        ({"a:1": "agg"}, {}, [DrainWorker("a:1")]),
        (
            {"a:1": "agg", "b:1": "agg"},
            {"b:1": "agg", "c:1": "agg"},
            [DrainWorker("a:1"), AddWorker("c:1", "agg")],
        ),
        ({"a:1": "agg"}, {"a:1": "decode"}, [AddWorker("a:1", "decode")]),
        ({"a:1": "agg"}, {"a:1": "agg"}, []),
    ],
    ids=["nothing", "adds-sorted", "drain", "drains-before-adds", "role-change-re-adds", "unchanged"],
)
def test_diff(old: dict[str, Role], new: dict[str, Role], changes: list[Change]) -> None:
    assert diff_workers(old, new) == changes


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("workers.ns.svc.cluster.local:50061", DnsTarget("workers.ns.svc.cluster.local", 50061, "agg")),
        ("prefill=prefill.ns.svc:50061", DnsTarget("prefill.ns.svc", 50061, "prefill")),
        ("decode=[fd00::1]:7", DnsTarget("fd00::1", 7, "decode")),
    ],
)
def test_parse_dns_target(text: str, target: DnsTarget) -> None:
    assert parse_dns_target(text) == target


@pytest.mark.parametrize(
    "text",
    ["workers", "workers:", "workers:0", "workers:70000", "leader=workers:1", "fd00::1:7", "a b:1", ":1"],
)
def test_parse_dns_target_refusals(text: str) -> None:
    with pytest.raises(RecordError):
        parse_dns_target(text)


def test_parse_worker() -> None:
    assert parse_worker("10.0.0.1:50061") == ("10.0.0.1:50061", "agg")
    assert parse_worker("decode=host:1") == ("host:1", "decode")


def test_dns_view_adds_drains_and_keeps_the_other_targets() -> None:
    agg, prefill = DnsTarget("w", 50061), DnsTarget("p", 6000, "prefill")
    view = DnsView((agg, prefill))
    assert view.resolved(agg, ["10.0.0.2", "10.0.0.1"]) == [
        AddWorker("10.0.0.1:50061", "agg"),
        AddWorker("10.0.0.2:50061", "agg"),
    ]
    assert view.resolved(prefill, ["10.0.0.9", "fd00::9"]) == [
        AddWorker("10.0.0.9:6000", "prefill"),
        AddWorker("[fd00::9]:6000", "prefill"),
    ]
    # A Pod gone from one name drains only that Pod; the other name's answer stands.
    assert view.resolved(agg, ["10.0.0.2", "10.0.0.3"]) == [
        DrainWorker("10.0.0.1:50061"),
        AddWorker("10.0.0.3:50061", "agg"),
    ]
    assert view.resolved(agg, ["10.0.0.3", "10.0.0.2"]) == []
    assert view.workers() == {
        "10.0.0.2:50061": "agg",
        "10.0.0.3:50061": "agg",
        "10.0.0.9:6000": "prefill",
        "[fd00::9]:6000": "prefill",
    }


def test_dns_view_an_address_under_two_names_has_the_first_names_role() -> None:
    first, second = DnsTarget("a", 1, "prefill"), DnsTarget("b", 1, "decode")
    view = DnsView((first, second))
    view.resolved(second, ["10.0.0.1"])
    assert view.resolved(first, ["10.0.0.1"]) == [AddWorker("10.0.0.1:1", "prefill")]
    assert view.resolved(first, []) == [AddWorker("10.0.0.1:1", "decode")]  # still listed by b


def test_etcd_view_put_delete_and_bad_values() -> None:
    view = EtcdView()
    assert view.put(b"/w/a:1", rec("a:1", "prefill")) == [AddWorker("a:1", "prefill")]
    assert view.put(b"/w/a:1", rec("a:1", "prefill")) == [], "a refreshed value changes nothing"
    changes = view.put(b"/w/junk", b"{")
    assert len(changes) == 1
    assert isinstance(changes[0], Rejected)
    assert changes[0].key == "/w/junk"
    assert view.delete(b"/w/junk") == [], "a bad key going is nothing"
    assert view.delete(b"/w/never") == []
    assert view.delete(b"/w/a:1") == [DrainWorker("a:1")]


def test_etcd_view_a_value_that_turns_bad_removes_its_worker() -> None:
    view = EtcdView()
    view.put(b"/w/a:1", rec("a:1"))
    changes = view.put(b"/w/a:1", b"[]")
    assert isinstance(changes[0], Rejected)
    assert changes[1:] == [DrainWorker("a:1")]


def test_etcd_view_two_keys_for_one_address_count_once() -> None:
    view = EtcdView()
    assert view.put(b"/w/x", rec("a:1")) == [AddWorker("a:1", "agg")]
    assert view.put(b"/w/y", rec("a:1")) == []
    assert view.delete(b"/w/x") == []
    assert view.delete(b"/w/y") == [DrainWorker("a:1")]


def test_etcd_resync_catches_up_with_what_changed_meanwhile() -> None:
    view = EtcdView()
    view.resync([(b"/w/a:1", rec("a:1")), (b"/w/b:1", rec("b:1"))])
    assert view.resync([(b"/w/b:1", rec("b:1", "decode")), (b"/w/c:1", rec("c:1"))]) == [
        DrainWorker("a:1"),
        AddWorker("b:1", "decode"),
        AddWorker("c:1", "agg"),
    ]


def test_missing_workers_are_those_the_sink_does_not_hold() -> None:
    view: dict[str, Role] = {"a:1": "agg", "b:1": "prefill"}
    assert missing_workers(view, frozenset({"a:1", "z:1"})) == [AddWorker("b:1", "prefill")]
    assert missing_workers(view, frozenset(view)) == []


events = st.lists(
    st.tuples(
        st.sampled_from([b"/w/k1", b"/w/k2", b"/w/k3", b"/w/k4"]),
        st.one_of(
            st.none(),  # a delete
            st.tuples(
                st.sampled_from(["a:1", "b:1", "c:1"]), st.sampled_from(["agg", "prefill", "decode"])
            ).map(
                lambda ar: rec(ar[0], ar[1])  # type: ignore[arg-type]
            ),
            st.just(b"garbage"),
        ),
    ),
    max_size=40,
)


@given(events, st.integers(0, 40))
def test_applying_the_changes_always_gives_the_view(
    stream: list[tuple[bytes, bytes | None]], resync_at: int
) -> None:
    """Whatever order keys come and go in (with a resync somewhere), a sink fed only the
    changes holds exactly the view's workers with the view's roles."""
    view = EtcdView()
    store: dict[bytes, bytes] = {}
    sink: dict[str, Role] = {}
    for step, (key, value) in enumerate(stream):
        if value is None:
            store.pop(key, None)
            changes = view.delete(key)
        else:
            store[key] = value
            changes = view.put(key, value)
        if step == resync_at:
            changes += view.resync(sorted(store.items()))
        for change in changes:
            if isinstance(change, AddWorker):
                sink[change.address] = change.role
            elif isinstance(change, DrainWorker):
                assert change.address in sink, "a drain is only for a worker that was added"
                del sink[change.address]
        assert sink == view.workers()
