"""Sticky sessions, the pure part: the table (bound, idle expiry, each worker's count) and where
a session's turn goes (stay, start on the least loaded, move when saturated, failed or gone)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from sidecar_frontend.routing.sessions import (
    DEFAULT_SESSION_HEADERS,
    MAX_SESSION_ID_BYTES,
    Candidate,
    Reason,
    SessionSettings,
    SessionTable,
    Turn,
    choose_worker,
    decide,
    keep_or_move,
    rendezvous_weight,
    running_limit,
    saturated,
    session_of,
)

# ---------------------------------------------------------------- the header


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-SMG-Routing-Key": "s1"}, "s1"),  # slime, Miles
        ({"X-Session-ID": "traj-7"}, "traj-7"),  # SkyRL
        ({"x-session-id": "traj-8"}, "traj-8"),  # prime-rl's router flag spells it so
        ({"X-SMG-Routing-Key": "a", "X-Session-ID": "b"}, "a"),  # the first header listed wins
        ({"X-SMG-Routing-Key": "", "X-Session-ID": "b"}, "b"),  # an empty value names nothing
        ({"X-Request-Id": "r"}, None),
        ({}, None),
        ({"X-Session-ID": "x" * MAX_SESSION_ID_BYTES}, "x" * MAX_SESSION_ID_BYTES),
        ({"X-Session-ID": "x" * (MAX_SESSION_ID_BYTES + 1)}, None),  # routed without a session
        ({"X-Session-ID": "é" * (MAX_SESSION_ID_BYTES // 2 + 1)}, None),  # bytes, not characters
    ],
)
def test_a_request_names_its_session_by_either_dialects_header(
    headers: dict[str, str], expected: str | None
) -> None:
    assert session_of(CIMultiDict(headers), DEFAULT_SESSION_HEADERS) == expected


# ---------------------------------------------------------------- the table


def test_a_sessions_turns_count_on_its_worker_and_a_move_moves_the_count() -> None:
    table = SessionTable(max_sessions=10, idle=None)
    assert table.assign(("agg", "s"), "w1", now=1.0) == []
    assert table.assign(("agg", "t"), "w1", now=2.0) == []
    assert dict(table.held_by_worker()) == {"w1": 2}
    table.assign(("agg", "s"), "w1", now=3.0)
    found = table.get(("agg", "s"))
    assert found is not None
    assert (found.worker, found.turns, found.started, found.last_used) == (
        "w1",
        2,
        1.0,
        3.0,
    )
    table.assign(("agg", "s"), "w2", now=4.0)
    assert dict(table.held_by_worker()) == {"w1": 1, "w2": 1}
    assert table.held("w2") == 1
    assert table.held("w3") == 0
    assert [key for key, _ in table] == [("agg", "t"), ("agg", "s")], "least recently used first"


def test_past_its_bound_the_table_forgets_the_least_recently_used_session() -> None:
    table = SessionTable(max_sessions=2, idle=None)
    table.assign(("agg", "a"), "w1", now=1.0)
    table.assign(("agg", "b"), "w2", now=2.0)
    table.assign(("agg", "a"), "w1", now=3.0)  # a is used again: b is now the oldest
    evicted = table.assign(("agg", "c"), "w1", now=4.0)
    assert [key for key, _ in evicted] == [("agg", "b")]
    assert len(table) == 2
    assert table.get(("agg", "b")) is None
    assert dict(table.held_by_worker()) == {"w1": 2}


def test_an_idle_session_expires_and_a_used_one_does_not() -> None:
    table = SessionTable(max_sessions=10, idle=60.0)
    table.assign(("agg", "old"), "w1", now=0.0)
    table.assign(("agg", "used"), "w2", now=0.0)
    table.assign(("agg", "used"), "w2", now=30.0)
    assert table.expire(59.9) == []
    expired = table.expire(60.0)
    assert [key for key, _ in expired] == [("agg", "old")]
    assert table.expire(89.9) == []
    assert [key for key, _ in table.expire(90.0)] == [("agg", "used")]
    assert len(table) == 0
    assert dict(table.held_by_worker()) == {}


def test_without_an_idle_bound_nothing_expires() -> None:
    table = SessionTable(max_sessions=10, idle=None)
    table.assign(("agg", "s"), "w1", now=0.0)
    assert table.expire(1e12) == []


def test_a_released_session_is_forgotten_and_releasing_an_unknown_one_is_nothing() -> None:
    table = SessionTable(max_sessions=10, idle=None)
    table.assign(("agg", "s"), "w1", now=0.0)
    released = table.release(("agg", "s"))
    assert released is not None
    assert released.worker == "w1"
    assert table.release(("agg", "s")) is None
    assert len(table) == 0
    assert table.held("w1") == 0


@dataclass
class _Reference:
    """The table as a plain ordered dict, checked against the real one."""

    max_sessions: int
    idle: float | None
    sessions: OrderedDict[tuple[str, str], tuple[str, float]]


_KEYS = st.sampled_from([("agg", s) for s in "abcdefg"] + [("prefill", "a")])
_WORKERS = st.sampled_from(["w1", "w2", "w3"])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), _KEYS, _WORKERS, st.floats(0, 50)),
        st.tuples(st.just("release"), _KEYS, st.just(""), st.just(0.0)),
        st.tuples(st.just("expire"), _KEYS, st.just(""), st.floats(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_OPS,
    max_sessions=st.integers(1, 5),
    idle=st.one_of(st.none(), st.floats(1, 100)),
)
def test_the_table_is_an_lru_dict_bounded_and_expiring_with_exact_counts(
    ops: list[tuple[str, tuple[str, str], str, float]], max_sessions: int, idle: float | None
) -> None:
    table = SessionTable(max_sessions, idle)
    ref = _Reference(max_sessions, idle, OrderedDict())
    now = 0.0
    for op, key, worker, step in ops:
        now += step
        if op == "assign":
            evicted = table.assign(key, worker, now)
            ref.sessions[key] = (worker, now)
            ref.sessions.move_to_end(key)
            expected = []
            while len(ref.sessions) > max_sessions:
                expected.append(ref.sessions.popitem(last=False)[0])
            assert [k for k, _ in evicted] == expected
        elif op == "release":
            found = table.release(key)
            was = ref.sessions.pop(key, None)
            assert (found.worker if found is not None else None) == (was[0] if was is not None else None)
        else:
            expired = table.expire(now)
            expected = [k for k, (_, used) in ref.sessions.items() if idle is not None and now - used >= idle]
            for k in expected:
                del ref.sessions[k]
            assert [k for k, _ in expired] == expected
            if idle is not None:
                assert all(now - s.last_used < idle for _, s in table)
        assert len(table) <= max_sessions
        assert [(k, s.worker) for k, s in table] == [(k, w) for k, (w, _) in ref.sessions.items()]
        counts: dict[str, int] = {}
        for _, (w, _) in ref.sessions.items():
            counts[w] = counts.get(w, 0) + 1
        assert dict(table.held_by_worker()) == counts


# ---------------------------------------------------------------- saturation and limits


@pytest.mark.parametrize(
    ("candidate", "factor", "expected"),
    [
        (Candidate("w", running=63, limit=64), 1.0, False),
        (Candidate("w", running=64, limit=64), 1.0, True),  # full: the turn would queue there
        (Candidate("w", running=80, limit=64), 1.25, True),
        (Candidate("w", running=79, limit=64), 1.25, False),
        (Candidate("w", running=10_000, limit=64), float("inf"), False),  # never
        (Candidate("w", running=5, limit=0), 1.0, False),  # no limit known: never
    ],
)
def test_a_worker_is_saturated_at_the_factor_times_its_running_limit(
    candidate: Candidate, factor: float, expected: bool
) -> None:
    assert saturated(candidate, factor) is expected


def test_the_running_limit_is_the_override_else_the_engines_else_the_default() -> None:
    settings_ = SessionSettings(worker_capacity={"a:1": 4}, default_running_limit=32)
    assert running_limit("a:1", 256, settings_) == 4
    assert running_limit("b:1", 256, settings_) == 256
    assert running_limit("b:1", 0, settings_) == 32


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"idle": 0.0}, "idle"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"saturation": 0.0}, "saturation"),
        ({"spread": -1}, "spread"),
        ({"headers": ()}, "header"),
        ({"default_running_limit": 0}, "default_running_limit"),
    ],
)
def test_settings_refuse_what_cannot_work(bad: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SessionSettings(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- where a turn goes

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


@pytest.mark.parametrize(
    ("held", "candidates", "excluded", "expected"),
    [
        (None, [Candidate(A)], frozenset(), Reason.STARTED),
        (A, [Candidate(A), Candidate(B)], frozenset(), Reason.KEPT),
        # Saturated while B is not: moves.
        (A, [Candidate(A, running=4, limit=4), Candidate(B, limit=4)], frozenset(), Reason.SATURATED),
        # Saturated, but so is everyone else: moving gains nothing.
        (A, [Candidate(A, running=4, limit=4), Candidate(B, running=9, limit=4)], frozenset(), Reason.KEPT),
        (A, [Candidate(A, running=4, limit=4)], frozenset(), Reason.KEPT),
        # Its worker failed this turn (the attempt runner excluded it).
        (A, [Candidate(B)], frozenset({A}), Reason.FAILOVER),
        # Its worker serves no more (ejected, draining, gone, another model).
        (A, [Candidate(B), Candidate(C)], frozenset(), Reason.UNAVAILABLE),
    ],
)
def test_a_turn_stays_unless_its_worker_is_saturated_failed_or_gone(
    held: str | None, candidates: list[Candidate], excluded: frozenset[str], expected: Reason
) -> None:
    assert keep_or_move(held, candidates, excluded, saturation=1.0) is expected


def test_a_new_session_starts_on_the_worker_holding_the_fewest_sessions() -> None:
    candidates = [Candidate(A, sessions=3), Candidate(B, sessions=1), Candidate(C, sessions=2)]
    assert choose_worker("s", candidates, saturation=1.0) == B


def test_among_the_least_loaded_the_longest_predicted_prefix_wins() -> None:
    candidates = [
        Candidate(A, sessions=1, cached_tokens=512),
        Candidate(B, sessions=1, cached_tokens=64),
        Candidate(C, sessions=2, cached_tokens=4096),  # busier: out of the tie with spread 0
    ]
    assert choose_worker("s", candidates, saturation=1.0) == A
    assert choose_worker("s", candidates, saturation=1.0, spread=1) == C


def test_with_no_prefix_anywhere_the_rendezvous_weight_decides_whatever_the_order() -> None:
    candidates = [Candidate(A), Candidate(B), Candidate(C)]
    for session in ("s1", "s2", "s3", "trajectory-42"):
        expected = max((A, B, C), key=lambda a: rendezvous_weight(session, a))
        assert choose_worker(session, candidates, saturation=1.0) == expected
        assert choose_worker(session, candidates[::-1], saturation=1.0) == expected


def test_the_rendezvous_weight_is_the_same_in_every_process() -> None:
    # Python's own string hash changes with each process (PYTHONHASHSEED); this must not.
    code = (
        "from sidecar_frontend.routing.sessions import rendezvous_weight;"
        "print(rendezvous_weight('trajectory-42', '10.0.0.1:1'))"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == rendezvous_weight("trajectory-42", "10.0.0.1:1")
    assert rendezvous_weight("a", "b") != rendezvous_weight("b", "a")


def test_a_saturated_worker_is_chosen_only_when_every_one_is() -> None:
    busy = Candidate(A, sessions=0, running=8, limit=8, cached_tokens=999)
    free = Candidate(B, sessions=5, running=0, limit=8)
    assert choose_worker("s", [busy, free], saturation=1.0) == B
    busier = Candidate(B, sessions=5, running=9, limit=8)
    assert choose_worker("s", [busy, busier], saturation=1.0) == A


def test_no_candidate_no_worker() -> None:
    assert choose_worker("s", [], saturation=1.0) is None
    assert decide("s", None, []) == Turn(None, Reason.STARTED)


def test_a_move_reports_what_the_router_predicted_on_the_worker_left_behind() -> None:
    candidates = [Candidate(A, running=4, limit=4, cached_tokens=3000), Candidate(B, limit=4)]
    turn = decide("s", A, candidates, held_cached_tokens=3000)
    assert turn == Turn(B, Reason.SATURATED, 3000)
    assert decide("s", A, candidates[1:], frozenset({A}), held_cached_tokens=3000) == Turn(
        B, Reason.FAILOVER, 3000
    )
    assert decide("s", None, candidates, held_cached_tokens=0) == Turn(B, Reason.STARTED, 0)
    kept = decide("s", A, [Candidate(A, running=3, limit=4), Candidate(B)], held_cached_tokens=3000)
    assert kept == Turn(A, Reason.KEPT, 0)


# ---------------------------------------------------------------- laws

_ADDRESSES = [f"10.0.0.{n}:1" for n in range(1, 7)]


@st.composite
def _fleets(draw: st.DrawFn) -> list[Candidate]:
    addresses = draw(st.lists(st.sampled_from(_ADDRESSES), min_size=1, max_size=6, unique=True))
    return [
        Candidate(
            address,
            sessions=draw(st.integers(0, 6)),
            running=draw(st.integers(0, 10)),
            limit=draw(st.integers(0, 8)),
            cached_tokens=draw(st.sampled_from([0, 0, 16, 64, 256])),
        )
        for address in addresses
    ]


@settings(max_examples=500, deadline=None)
@given(
    candidates=_fleets(),
    held=st.one_of(st.none(), st.sampled_from(_ADDRESSES)),
    excluded_held=st.booleans(),
    saturation=st.sampled_from([0.5, 1.0, 1.5, float("inf")]),
    spread=st.integers(0, 3),
    session=st.text(min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_where_a_turn_goes(
    candidates: list[Candidate],
    held: str | None,
    excluded_held: bool,
    saturation: float,
    spread: int,
    session: str,
    order: object,
) -> None:
    excluded = frozenset({held}) if held is not None and excluded_held else frozenset()
    candidates = [c for c in candidates if c.address not in excluded]
    turn = decide(session, held, candidates, excluded, saturation=saturation, spread=spread)
    by_address = {c.address: c for c in candidates}
    if not candidates:
        assert turn.worker is None
        return
    # The turn goes to a candidate; it stays exactly when its worker is one and is not
    # saturated, or when every other candidate is saturated too.
    assert turn.worker in by_address
    own = by_address.get(held) if held is not None else None
    others_free = any(c.address != held and not saturated(c, saturation) for c in candidates)
    stays = own is not None and (not saturated(own, saturation) or not others_free)
    assert (turn.reason is Reason.KEPT) is stays
    if stays:
        assert turn.worker == held
        return
    # A start or a move: never a saturated worker while an unsaturated one is left, never back
    # to the worker a saturated session leaves, and the least loaded within the spread.
    pool = [c for c in candidates if not (turn.reason is Reason.SATURATED and c.address == held)]
    free = [c for c in pool if not saturated(c, saturation)]
    pool = free or pool
    chosen = by_address[turn.worker]
    assert chosen in pool
    assert chosen.sessions <= min(c.sessions for c in pool) + spread
    if turn.reason is not Reason.STARTED:
        assert turn.worker != held
    # The same fleet in another order: the same worker (every process decides alike).
    shuffled = list(candidates)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    assert decide(session, held, shuffled, excluded, saturation=saturation, spread=spread) == turn


@settings(max_examples=200, deadline=None)
@given(workers=st.integers(1, 6), sessions=st.integers(0, 60))
def test_new_sessions_spread_evenly_over_idle_workers(workers: int, sessions: int) -> None:
    table = SessionTable(max_sessions=1000, idle=None)
    addresses = _ADDRESSES[:workers]
    for n in range(sessions):
        candidates = [Candidate(a, sessions=table.held(a)) for a in addresses]
        turn = decide(f"s{n}", None, candidates)
        assert turn.worker is not None
        table.assign(("agg", f"s{n}"), turn.worker, now=float(n))
    counts = [table.held(a) for a in addresses]
    assert max(counts) - min(counts) <= 1
