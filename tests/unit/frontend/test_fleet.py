"""The fleet's pauses and weight versions, pure (``fleet.py``): which workers take new requests,
how GET /workers lists them, how long a request waits, and which version is the newest; tables,
then hypothesis laws over random histories of reports."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.fleet import (
    DEFAULT_PAUSED_HOLD_SECS,
    FleetSettings,
    WeightVersions,
    held,
    held_reason,
    listed_state,
    placement_wait,
    takes_new,
)


@pytest.mark.parametrize(
    ("eligible", "paused", "current", "expected"),
    [
        (True, False, True, True),
        (True, True, True, False),  # paused: no new request
        (True, False, False, False),  # behind the newest version
        (False, False, True, False),  # down, ejected or refused
        (False, True, False, False),
    ],
)
def test_which_workers_take_new_requests(eligible: bool, paused: bool, current: bool, expected: bool) -> None:
    assert takes_new(eligible=eligible, paused=paused, current=current) is expected


@pytest.mark.parametrize(
    ("state", "paused", "current", "listed"),
    [
        ("serving", False, True, "serving"),
        ("serving", True, True, "paused"),
        ("serving", True, False, "paused"),  # its pause is what it is doing now
        ("serving", False, False, "pending"),
        ("not_serving", True, False, "not_serving"),  # down is down, whatever it said before
        ("draining", False, False, "draining"),
        ("connecting", False, True, "connecting"),
    ],
)
def test_how_get_workers_lists_a_worker(state: str, paused: bool, current: bool, listed: str) -> None:
    assert listed_state(state, paused=paused, current=current) == listed


@pytest.mark.parametrize(
    ("eligible", "taking_new", "expected"),
    [(0, 0, False), (3, 0, True), (3, 1, False), (1, 1, False)],
)
def test_a_model_is_held_while_its_workers_serve_but_none_takes_new_requests(
    eligible: int, taking_new: int, expected: bool
) -> None:
    assert held(eligible=eligible, taking_new=taking_new) is expected


@pytest.mark.parametrize(
    ("worker_wait", "hold", "fleet_held", "expected"),
    [
        (0.0, 600.0, False, 0.0),  # a first attempt with nobody serving: 503 at once, as before
        (0.0, 600.0, True, 600.0),  # every worker paused: it waits for continue
        (5.0, 600.0, False, 5.0),  # a retry waits for a worker to come back
        (5.0, 2.0, True, 5.0),  # never less than it waited before the feature
        (0.0, 0.0, True, 0.0),  # --paused-hold-secs 0: no hold
    ],
)
def test_how_long_an_attempt_waits(
    worker_wait: float, hold: float, fleet_held: bool, expected: float
) -> None:
    assert placement_wait(worker_wait, hold, fleet_held=fleet_held) == expected


def test_the_hold_is_generous_by_default_and_never_negative() -> None:
    assert FleetSettings().paused_hold == DEFAULT_PAUSED_HOLD_SECS == 600.0
    assert not FleetSettings().route_latest_weights
    with pytest.raises(ValueError, match="paused_hold"):
        FleetSettings(paused_hold=-1.0)


def test_the_reason_names_the_pause_or_the_version() -> None:
    assert held_reason("m", paused=3, pending=0, newest=None) == "every worker of m is paused (3)"
    reason = held_reason("m", paused=1, pending=2, newest="v2")
    assert "1 paused" in reason
    assert "2 not at the newest weight version 'v2'" in reason


# ------------------------------------------------------------------ the newest version


@pytest.mark.parametrize(
    ("history", "newest"),
    [
        ([("a", "v1")], "v1"),  # the first version anyone reports
        ([("a", "v1"), ("b", "v1"), ("a", "v2")], "v2"),  # a change is news
        ([("a", "v1"), ("b", "v2")], "v2"),  # a first report of a version nobody reported before
        # b restarted: its first report is of a version the fleet had before: no news.
        ([("a", "v1"), ("b", "v1"), ("a", "v2"), ("b", "v2"), ("b", "forget"), ("b", "v1")], "v2"),
        # every one moves on: the last change is the newest
        ([("a", "v1"), ("b", "v1"), ("a", "v2"), ("b", "v2"), ("a", "v3")], "v3"),
        # a change to a version nobody made the newest yet is news
        ([("a", "v2"), ("a", "v1")], "v1"),
        # never back to a version the fleet moved past, even as a change: a restarted engine
        # whose sidecar went on reporting its version from before the restart
        ([("a", "v1"), ("b", "v1"), ("a", "v2"), ("b", "v2"), ("b", "v1")], "v2"),
        ([("a", "v1"), ("a", "v2"), ("a", "v1")], "v2"),
        # reporting the same version again is no change
        ([("a", "v1"), ("b", "v1"), ("b", "v2"), ("a", "v1")], "v2"),
        # a worker that stops saying is left out; its next version is a first report
        ([("a", "v1"), ("a", None), ("b", "v2"), ("a", "v1")], "v2"),
        # a version weighed while another worker was down (a first report, never seen): news
        ([("a", "v1"), ("b", "v1"), ("a", "forget"), ("a", "v2")], "v2"),
    ],
)
def test_the_newest_version_follows_the_reports(history: list[tuple[str, str | None]], newest: str) -> None:
    versions = WeightVersions()
    for address, version in history:
        if version == "forget":
            versions.forget(address)
        else:
            versions.report(address, version)
    assert versions.newest == newest


def test_an_admin_call_sets_the_newest_until_it_gives_the_choice_back() -> None:
    versions = WeightVersions()
    versions.report("a", "v1")
    assert not versions.routes_by_version, "without the flag, versions do not route"
    assert versions.current("old")
    news = versions.set_admin("v7")
    assert news.newest_changed
    assert versions.newest == "v7"
    assert versions.set_by_admin
    assert versions.routes_by_version, "an admin call that sets a version routes by it"
    assert not versions.current("v1")
    assert versions.current("v7")
    versions.report("a", "v2")  # a change: the reported newest moves on underneath
    assert versions.newest == "v7"
    versions.set_admin(None)
    assert versions.newest == "v2"
    assert not versions.set_by_admin
    assert not versions.routes_by_version


def test_with_the_flag_only_the_newest_version_is_current() -> None:
    versions = WeightVersions(route_latest_weights=True)
    assert versions.current(None), "no version known yet: every worker is current"
    assert versions.current("any")
    versions.report("a", "v1")
    assert versions.current("v1")
    assert not versions.current("v0")
    assert not versions.current(None), "a worker that reports no version waits for one"


def test_mixed_and_uniform_are_news_once() -> None:
    versions = WeightVersions()
    assert versions.report("a", "v1").mixed is None
    assert versions.report("b", "v1").mixed is None
    assert versions.report("a", "v2").mixed is True
    assert versions.report("a", "v2").mixed is None
    assert versions.report("b", "v2").mixed is False
    assert versions.counts() == {"v2": 2}


# ------------------------------------------------------------------ laws

ADDRESSES = ["a", "b", "c", "d"]
VERSIONS = ["v0", "v1", "v2", "v3"]


@dataclass(frozen=True)
class Report:
    address: str
    version: str | None


@dataclass(frozen=True)
class Forget:
    address: str


@dataclass(frozen=True)
class Admin:
    version: str | None


steps = st.lists(
    st.one_of(
        st.builds(Report, st.sampled_from(ADDRESSES), st.one_of(st.none(), st.sampled_from(VERSIONS))),
        st.builds(Forget, st.sampled_from(ADDRESSES)),
        st.builds(Admin, st.one_of(st.none(), st.sampled_from(VERSIONS))),
    ),
    max_size=40,
)


@given(steps)
def test_laws_of_the_newest_version(history: list[Report | Forget | Admin]) -> None:
    versions = WeightVersions(route_latest_weights=True)
    reported: set[str] = set()
    moved_past: set[str] = set()
    admin: str | None = None
    for step in history:
        before = versions.version_of(step.address) if not isinstance(step, Admin) else None
        if isinstance(step, Report):
            was = versions.reported
            versions.report(step.address, step.version)
            if step.version is not None:
                reported.add(step.version)
                if before is not None and before != step.version:
                    # a version change seen from a worker makes it the newest, unless the fleet
                    # moved past that version before
                    assert (versions.reported == step.version) is (step.version not in moved_past)
                if was is not None and versions.reported != was:
                    moved_past.add(was)
                assert versions.reported not in moved_past
        elif isinstance(step, Forget):
            versions.forget(step.address)
        else:
            versions.set_admin(step.version)
            admin = step.version
        newest = versions.newest
        # never invented: the admin's, or one a worker reported
        assert newest is None or newest == admin or newest in reported
        if admin is not None:
            assert newest == admin
        # with the flag, a worker is current only at the newest version (once one is known)
        for version in [None, *VERSIONS]:
            if versions.current(version) and newest is not None:
                assert version == newest
        assert versions.mixed == (len(versions.counts()) > 1)
