"""A call its worker's server never started (NOT_STARTED): paused and run again, bounded, and
never counted as a move (issue 29)."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_frontend.attempts import UNSTARTED_BACKOFF, UNSTARTED_LIMIT, Attempts
from sidecar_frontend.formats.base import WorkerFailure


def attempts(limit: int = 3) -> Attempts:
    return Attempts(sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[1, 2]), limit)


@given(
    st.lists(st.floats(min_value=0.0, max_value=0.999), min_size=UNSTARTED_LIMIT, max_size=UNSTARTED_LIMIT)
)
def test_pauses_double_within_the_backoff_then_run_out(draws: list[float]) -> None:
    a = attempts()
    for n, draw in enumerate(draws, start=1):
        pause = a.after_unstarted(functools.partial(float, draw))
        assert pause is not None
        assert UNSTARTED_BACKOFF.ceiling(n) / 2 <= pause <= UNSTARTED_BACKOFF.ceiling(n)
    assert a.after_unstarted(lambda: 0.5) is None
    # None of them was a move: the migration limit is whole for real failures.
    assert a.moves == 0


def test_the_first_pause_is_short_and_the_cap_holds() -> None:
    assert UNSTARTED_BACKOFF.ceiling(1) == 0.05
    assert UNSTARTED_BACKOFF.ceiling(UNSTARTED_LIMIT) == 1.0


def test_after_a_busy_answer_an_unstarted_call_may_go_back_to_any_worker() -> None:
    a = attempts()
    a.after_failure(WorkerFailure.of(FailureReason.OVERLOADED, "busy"))
    assert not a.patient
    a.after_unstarted(lambda: 0.0)
    assert a.patient
