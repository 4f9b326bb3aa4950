"""Fault plans: the request-id directive and the in-process book."""

from __future__ import annotations

import pytest
from testkit.faults import (
    FaultBook,
    FaultKind,
    FaultPlan,
    parse_directive,
    parse_fault_flag,
    plan_from_request_id,
)


@pytest.mark.parametrize(
    ("rid", "expected"),
    [
        ("r1.fault=close_after:3", FaultPlan(FaultKind.CLOSE_AFTER, after=3)),
        ("r7.fault=engine_dies:5", FaultPlan(FaultKind.ENGINE_DIES, after=5)),
        ("priv-9-r1.fault=fail_open", FaultPlan(FaultKind.FAIL_OPEN)),
        (
            "x.fault=error_after:2:RESOURCE_EXHAUSTED",
            FaultPlan(FaultKind.ERROR_AFTER, 2, code="RESOURCE_EXHAUSTED"),
        ),
        ("x.fault=error_after:1", FaultPlan(FaultKind.ERROR_AFTER, 1)),
        ("x.fault=hang", FaultPlan(FaultKind.HANG)),
        ("x.fault=hang:4", FaultPlan(FaultKind.HANG, after=4)),
        (
            "x.fault=malformed_terminal:negative_id",
            FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="negative_id"),
        ),
        ("x.fault=malformed_terminal", FaultPlan(FaultKind.MALFORMED_TERMINAL)),
        ("x.fault=repeat_after_terminal", FaultPlan(FaultKind.REPEAT_AFTER_TERMINAL)),
        ("x.fault=stall_first_token:0.5", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=0.5)),
    ],
)
def test_directive_in_request_id(rid: str, expected: FaultPlan) -> None:
    assert plan_from_request_id(rid) == expected


@pytest.mark.parametrize(
    "rid", ["plain-id", "x.fault=nonsense", "x.fault=close_after:1.5", "x.fault=malformed_terminal:odd"]
)
def test_no_or_bad_directive_means_no_fault(rid: str) -> None:
    assert plan_from_request_id(rid) is None


def test_parse_directive_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_directive("explode")


def test_fault_flag() -> None:
    assert parse_fault_flag("req-a=close_after:2") == ("req-a", FaultPlan(FaultKind.CLOSE_AFTER, 2))
    with pytest.raises(ValueError, match="MATCH="):
        parse_fault_flag("close_after:2")


def test_book_matches_by_substring_and_counts_uses() -> None:
    book = FaultBook()
    plan = FaultPlan(FaultKind.HANG, after=1)
    book.add("pub-7", plan, times=2)
    assert book.plan_for("private-1-pub-7") == plan
    assert book.plan_for("other") is None
    assert book.plan_for("private-2-pub-7") == plan
    assert book.plan_for("private-3-pub-7") is None


def test_book_entry_beats_directive_and_unbounded_entries_stay() -> None:
    book = FaultBook()
    book.add("r", FaultPlan(FaultKind.FAIL_OPEN))
    for _ in range(3):
        assert book.plan_for("r.fault=hang") == FaultPlan(FaultKind.FAIL_OPEN)
    book.clear()
    assert book.plan_for("r.fault=hang") == FaultPlan(FaultKind.HANG)


def test_book_refuses_empty_match_and_bad_times() -> None:
    book = FaultBook()
    with pytest.raises(ValueError, match="empty match"):
        book.add("", FaultPlan(FaultKind.HANG))
    with pytest.raises(ValueError, match="times"):
        book.add("x", FaultPlan(FaultKind.HANG), times=0)
