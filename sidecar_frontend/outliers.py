"""Outlier ejection: a worker that keeps failing requests of its own fault is taken out of
routing for a while, probed with one request, and brought back (issue 27, "Overload").

Pure: no I/O, no clock (``now`` is passed in), no logging. :class:`Outliers` keeps, per worker
address, the own-fault failures in a row and the ejections in a row ("strikes"), and decides:

- the ``consecutive_failures``-th own-fault failure in a row ejects the worker for
  ``first_ejection`` seconds, doubled for each strike, at most ``max_ejection``; a success in
  between starts the count over. A worker whose previous ejection ended ``max_ejection`` seconds
  or more before this one starts over at the first pause;
- once the caller brings the worker back (:meth:`Outliers.readmitted`) it is on probation: its
  next outcome decides. A success restores it (:attr:`Verdict.RESTORED`); a failure ejects it
  again at once, for the doubled pause;
- while ejected, the outcomes of its calls still in flight are not counted (they are the same
  spell; the probe decides).

Which failures are the worker's own fault is :data:`OWN_FAULT`, one row per
:class:`~sidecar_common.errors.FailureReason`. A busy answer (OVERLOADED) is not a fault (the
worker is there and says so; the retry budget and admission deal with load), nor is a request
the client got wrong (INVALID_ARGUMENT), a cancel (CANCELLED: the client's), or the frontend's
own reasons (DEADLINE, NO_WORKER), nor is anything a paused engine's calls meet
(:func:`counts_against`: ENGINE_PAUSED, or any failure while its sidecar reports it paused).

The caller owns the rest (``workers.py``): it never ejects the last eligible worker of a
model (it then calls :meth:`Outliers.spared`), takes the worker out of routing until
:attr:`Ejection.until`, marks it on probation, readmits it, logs and counts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sidecar_common.reasons import FailureReason
from sidecar_common.retry import Backoff

__all__ = ["OWN_FAULT", "Ejection", "OutlierSettings", "Outliers", "Verdict", "counts_against", "own_fault"]

_R = FailureReason
# Whether a call's failure for this reason is its worker's own fault (counts toward ejection).
OWN_FAULT: Final[Mapping[FailureReason, bool]] = {
    _R.INVALID_ARGUMENT: False,  # the request: any worker would refuse it
    _R.CANNOT_CONNECT: True,
    _R.CONNECTION_TIMEOUT: True,
    _R.ENGINE_SHUTDOWN: True,
    _R.CANCELLED: False,  # the client's cancel
    _R.OVERLOADED: False,  # busy is not a fault: admission and the retry budget handle it
    _R.PROTOCOL_ERROR: True,  # misbehaviour included
    _R.UNKNOWN: True,
    _R.ENGINE_PAUSED: False,  # its trainer paused it: paused is not down (issue 28)
    _R.NO_WORKER: False,  # the frontend's own: no call was made
    _R.DEADLINE: False,  # the frontend's own --request-timeout-secs
    _R.NOT_STARTED: False,  # a busy server's backlog, like OVERLOADED
}


def own_fault(reason: FailureReason) -> bool:
    """Whether a failure for ``reason`` counts against its worker (:data:`OWN_FAULT`)."""
    return OWN_FAULT[reason]


def counts_against(reason: FailureReason, *, paused: bool) -> bool:
    """Whether a failure for ``reason`` of a worker whose engine is ``paused`` (or not) counts
    toward its ejection: its own fault, and never while its engine is paused (a paused engine
    is not down: whatever its calls meet then is the pause's doing)."""
    return own_fault(reason) and not paused


@dataclass(frozen=True)
class OutlierSettings:
    """When a worker is ejected and for how long (see the module docstring)."""

    # Own-fault failures in a row that eject a worker; 0 disables ejection.
    consecutive_failures: int = 5
    # Seconds out of routing at the first ejection, doubling per repeated ejection up to the max.
    first_ejection: float = 10.0
    max_ejection: float = 300.0

    def __post_init__(self) -> None:
        if self.consecutive_failures < 0:
            raise ValueError(f"consecutive_failures must be >= 0, got {self.consecutive_failures}")
        if not 0 < self.first_ejection <= self.max_ejection:
            raise ValueError(
                "ejection times must satisfy 0 < first_ejection <= max_ejection, "
                f"got {self.first_ejection} and {self.max_ejection}"
            )


class Verdict(enum.Enum):
    """What a success changed."""

    NONE = "none"
    RESTORED = "restored"  # the worker was on probation and its call succeeded


@dataclass(frozen=True)
class Ejection:
    """A worker to take out of routing."""

    until: float  # back in routing at this time (the caller's clock)
    failures: int  # own-fault failures in a row that decided it (1: a failed probe)
    strikes: int  # ejections in a row, this one included (the pause doubles with each)


class _State(enum.Enum):
    IN = "in"
    EJECTED = "ejected"
    PROBING = "probing"


@dataclass
class _Record:
    state: _State = _State.IN
    failures: int = 0
    strikes: int = 0
    # When its last ejection ended (or will end): strikes are forgiven max_ejection after it.
    last_until: float = 0.0
    # strikes and last_until before the current ejection (what spared() puts back).
    before: tuple[int, float] = (0, 0.0)


class Outliers:
    """The per-worker counts and decisions of one frontend, keyed by worker address."""

    def __init__(self, settings: OutlierSettings | None = None) -> None:
        self.settings = settings if settings is not None else OutlierSettings()
        self._backoff = Backoff(self.settings.first_ejection, self.settings.max_ejection)
        self._records: dict[str, _Record] = {}

    def succeeded(self, address: str) -> Verdict:
        """A call on ``address`` ended with every terminal delivered."""
        record = self._records.get(address)
        if record is None or record.state is _State.EJECTED:
            return Verdict.NONE
        record.failures = 0
        if record.state is _State.PROBING:
            record.state = _State.IN
            return Verdict.RESTORED
        return Verdict.NONE

    def failed(self, address: str, now: float) -> Ejection | None:
        """A call on ``address`` failed of the worker's own fault (:func:`own_fault`) at
        ``now``: the ejection this decides, if any."""
        needed = self.settings.consecutive_failures
        if needed == 0:
            return None
        record = self._records.setdefault(address, _Record())
        if record.state is _State.EJECTED:
            return None
        record.failures += 1
        if record.state is not _State.PROBING and record.failures < needed:
            return None
        forgiven = record.strikes == 0 or now - record.last_until >= self.settings.max_ejection
        strikes = 1 if forgiven else record.strikes + 1
        until = now + self._backoff.ceiling(strikes)
        ejection = Ejection(until=until, failures=record.failures, strikes=strikes)
        record.before = (record.strikes, record.last_until)
        record.state, record.failures, record.strikes, record.last_until = _State.EJECTED, 0, strikes, until
        return ejection

    def spared(self, address: str) -> None:
        """The caller did not eject ``address`` after all (the last worker of its model): it
        stays in routing, its count starts over, the strike is taken back."""
        record = self._records.get(address)
        if record is None or record.state is not _State.EJECTED:
            return
        record.state = _State.IN
        record.failures = 0
        record.strikes, record.last_until = record.before

    def readmitted(self, address: str) -> bool:
        """The caller brought ``address`` back into routing: on probation, when this ejected
        it (whether it is)."""
        record = self._records.get(address)
        if record is None or record.state is not _State.EJECTED:
            return False
        record.state = _State.PROBING
        return True

    def probing(self, address: str) -> bool:
        """Whether ``address`` is on probation (its next outcome decides)."""
        record = self._records.get(address)
        return record is not None and record.state is _State.PROBING

    def forget(self, address: str) -> None:
        """``address`` left the fleet."""
        self._records.pop(address, None)
