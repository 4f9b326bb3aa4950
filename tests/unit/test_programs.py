"""The programs' shared edges: exit codes, the event-loop runner, the logprob floor."""

from __future__ import annotations

import math

import pytest

from sidecar_common.logprob_floor import LOGPROB_FLOOR, clamp_logprob
from sidecar_common.programs import EXIT_OK, EXIT_STARTUP_FAILED, EXIT_USAGE, run_event_loop


def test_exit_codes_are_distinct_and_usage_is_argparses() -> None:
    assert (EXIT_OK, EXIT_STARTUP_FAILED, EXIT_USAGE) == (0, 1, 2)


def test_the_runner_returns_what_the_program_returns() -> None:
    async def main(code: int) -> int:
        return code

    assert run_event_loop(main, 7) == 7


def test_ctrl_c_before_the_program_handles_signals_is_a_requested_stop() -> None:
    async def main() -> int:
        raise KeyboardInterrupt

    assert run_event_loop(main) == EXIT_OK


@pytest.mark.parametrize(
    ("value", "written"),
    [(-0.5, -0.5), (0.0, 0.0), (LOGPROB_FLOOR, LOGPROB_FLOOR), (-1e6, LOGPROB_FLOOR)]
    + [(v, LOGPROB_FLOOR) for v in (math.nan, math.inf, -math.inf)],
)
def test_a_logprob_is_finite_and_at_least_the_floor(value: float, written: float) -> None:
    assert clamp_logprob(value) == written
