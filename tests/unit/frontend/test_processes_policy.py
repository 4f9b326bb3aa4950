"""What the parent of ``--processes N`` does when a process ends (processes/policy.py)."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.processes.policy import (
    Next,
    RestartPolicy,
    after_exit,
    describe_exit,
    stopped_exit_code,
)

POLICY = RestartPolicy(first_pause=0.5, max_pause=10.0, healthy_after=60.0, max_failures=5)
KILLED = -int(signal.SIGKILL)


@pytest.mark.parametrize(
    ("exit_code", "served", "ran", "failures", "expected_next", "expected_failures"),
    [
        pytest.param(KILLED, True, 5.0, 0, Next.RESTART, 1, id="first crash: restart"),
        pytest.param(KILLED, True, 5.0, 3, Next.RESTART, 4, id="fourth in a row: restart"),
        pytest.param(KILLED, True, 5.0, 5, Next.GIVE_UP, 6, id="sixth in a row: give up"),
        pytest.param(KILLED, True, 61.0, 5, Next.RESTART, 1, id="served a while: a first failure again"),
        pytest.param(KILLED, False, 61.0, 2, Next.RESTART, 3, id="never served: no fresh start"),
        pytest.param(1, False, 1.0, 0, Next.GIVE_UP, 1, id="failed to start (exit 1): give up"),
        pytest.param(2, False, 1.0, 0, Next.GIVE_UP, 1, id="usage error (exit 2): give up"),
        pytest.param(1, True, 1.0, 0, Next.RESTART, 1, id="exit 1 after serving: a crash"),
        pytest.param(0, True, 1.0, 0, Next.RESTART, 1, id="stopped by someone else: restart"),
    ],
)
def test_after_exit(
    exit_code: int, served: bool, ran: float, failures: int, expected_next: Next, expected_failures: int
) -> None:
    verdict = after_exit(POLICY, exit_code=exit_code, served=served, ran=ran, failures=failures, jitter=0.0)
    assert (verdict.next, verdict.failures) == (expected_next, expected_failures)
    if verdict.next is Next.GIVE_UP:
        assert verdict.pause == 0.0


@given(failures=st.integers(0, 4), jitter=st.floats(0.0, 0.999))
def test_the_pause_doubles_up_to_the_cap_with_jitter(failures: int, jitter: float) -> None:
    verdict = after_exit(POLICY, exit_code=KILLED, served=True, ran=1.0, failures=failures, jitter=jitter)
    ceiling = min(POLICY.max_pause, POLICY.first_pause * 2**failures)
    assert ceiling / 2 <= verdict.pause <= ceiling


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([0, 0], 0),
        ([0, -int(signal.SIGTERM)], 0),  # ended by the stop's signal before it could take it
        ([], 0),
        ([0, 1], 1),
        ([0, KILLED], 1),
    ],
)
def test_the_exit_code_after_a_stop(codes: list[int], expected: int) -> None:
    assert stopped_exit_code(codes) == expected


def test_describe_exit() -> None:
    assert describe_exit(3) == "exit 3"
    assert describe_exit(KILLED) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"
