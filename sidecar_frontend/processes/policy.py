"""What the parent of ``--processes N`` does when one of its processes ends, and how it reads a
process that stops answering (pure: no I/O, no clock; durations are passed in).

A process that ends while the parent is not stopping is restarted after a pause from the
project's backoff (``sidecar_common.retry.Backoff``: doubling from ``first_pause`` up to
``max_pause``, jittered), counting its failures in a row; one that had served for
``healthy_after`` seconds fails as if for the first time. The parent gives up (stops every
process, exits 1) when:

- a process failed to start (exit 1 or 2 before it ever served): the same configuration or
  host fails every process alike, and one frontend exits 1 in that case too;
- a process failed more than ``max_failures`` times in a row: restarting is not curing it.

While the parent is stopping, an ending process is not restarted; the parent's exit code is
0 when every process ended as asked (exit 0, or ended by the stop signal itself before it
could take it), 1 otherwise (:func:`stopped_exit_code`).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from sidecar_common.programs import EXIT_OK, EXIT_STARTUP_FAILED, EXIT_USAGE
from sidecar_common.retry import Backoff

__all__ = [
    "Liveness",
    "Next",
    "RestartPolicy",
    "Verdict",
    "after_exit",
    "describe_exit",
    "stopped_exit_code",
]


@dataclass(frozen=True)
class RestartPolicy:
    first_pause: float = 0.5
    max_pause: float = 10.0
    # A process that served this long before it ended counts as a first failure again.
    healthy_after: float = 60.0
    # More failures than this in a row (each sooner than healthy_after): give up.
    max_failures: int = 5


@dataclass(frozen=True)
class Liveness:
    """A serving process's own event loop must answer its metrics endpoint: asked every
    ``interval`` seconds, each answer awaited ``timeout`` seconds; ``failures`` unanswered in a
    row and it is killed (and restarted): the same bounds as the Kubernetes manifests' liveness
    probe puts on a one-process frontend (deploy/README.md, "The frontend's probes")."""

    interval: float = 10.0
    timeout: float = 10.0
    failures: int = 6


class Next(Enum):
    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Verdict:
    next: Next
    failures: int  # in a row, this one included
    pause: float  # before the restart (0 when giving up)
    why: str  # for the log line


def after_exit(
    policy: RestartPolicy, *, exit_code: int, served: bool, ran: float, failures: int, jitter: float
) -> Verdict:
    """What to do after a process ended unasked. ``exit_code``: its status (negative: the signal
    that ended it); ``served``: whether it served before; ``ran``: seconds since it started;
    ``failures``: its failures in a row before this one; ``jitter`` uniform in [0, 1)."""
    if not served and exit_code in (EXIT_STARTUP_FAILED, EXIT_USAGE):
        return Verdict(Next.GIVE_UP, failures + 1, 0.0, "it failed to start")
    in_a_row = 1 if served and ran >= policy.healthy_after else failures + 1
    if in_a_row > policy.max_failures:
        return Verdict(Next.GIVE_UP, in_a_row, 0.0, f"it failed {in_a_row} times in a row")
    pause = Backoff(policy.first_pause, policy.max_pause).pause(in_a_row, lambda: jitter)
    return Verdict(Next.RESTART, in_a_row, pause, "restarting")


def stopped_exit_code(exit_codes: Iterable[int]) -> int:
    """The parent's exit code once every process ended after a requested stop."""
    asked = (EXIT_OK, -signal.SIGTERM)
    return EXIT_OK if all(code in asked for code in exit_codes) else EXIT_STARTUP_FAILED


def describe_exit(exit_code: int) -> str:
    """``exit 3`` or ``killed by SIGKILL``, for the log line."""
    if exit_code >= 0:
        return f"exit {exit_code}"
    try:
        return f"killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"killed by signal {-exit_code}"
