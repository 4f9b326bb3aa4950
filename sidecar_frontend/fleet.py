"""The fleet's pauses and weight versions: which workers take new requests, and when a request
waits for one (issue 28, "Pause-aware fleet" and "Weight versions"). Pure: no I/O, no clock, no
logging; the registry (``registry.py``) keeps the state, the worker set logs and counts.

**Pauses.** A trainer pauses its engines itself (SGLang ``/pause_generation``, vLLM
``/pause``), and each sidecar reports its engine's state in its load reports
(``LoadReport.engine_state``). A paused worker is still eligible: it is not down, never ejected
for its pause, and the requests waiting at its engine are left there (they run on continue).
It only takes no *new* request (:func:`takes_new`).

**Weight versions.** Each sidecar reports the version of the weights its engine serves
(``LoadReport.weight_version``). The fleet's newest version (:class:`WeightVersions`) is the
one an admin call set (``POST /weight_version``), else the one most recently reported as new:

- a worker whose version changes (it reported another one before) makes its new one the newest;
- a worker's first version (it just joined, or came back after it stopped serving: its earlier
  version is forgotten then) makes it the newest only when no worker reported that version
  before (or none reported any yet);
- but never a version the fleet already moved past (one that was the newest and was replaced):
  a restarted engine back at its launch weights waits, listed ``pending``, and never pulls the
  fleet back to them, even when its sidecar went on reporting the version it had before the
  restart (a change, then, from that one back to the old). A deliberate rollback is an admin
  call's to make.

With ``--route-latest-weights`` (or once an admin call set a version) only workers at the
newest version take new requests; a worker at another version, or one that reports none yet,
is ``pending`` until it reports the newest.

**Holding.** When a model's workers serve but none takes new requests (every one paused, or
none at the newest version), the fleet is *held* for that model (:func:`held`): a new request
waits, up to ``FleetSettings.paused_hold`` seconds, for one to take it, rather than being
answered 503 at once (:func:`placement_wait`).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_PAUSED_HOLD_SECS",
    "MAX_WEIGHT_VERSION_BYTES",
    "PAUSED_REFUSALS_LIMIT",
    "PENDING",
    "SEEN_VERSIONS_KEPT",
    "EngineState",
    "FleetSettings",
    "VersionNews",
    "WeightVersions",
    "held",
    "held_reason",
    "listed_state",
    "placement_wait",
    "takes_new",
]

# A fleet paused for a weight update holds new requests this long by default (the issue's
# "default generous, e.g. 10 minutes").
DEFAULT_PAUSED_HOLD_SECS: Final = 600.0
# A reported version longer than this is absurd (the sidecar misbehaves): SGLang's are names or
# step numbers.
MAX_WEIGHT_VERSION_BYTES: Final = 1_024
# The versions remembered as reported before (a worker's first report of one of them is not
# news), and as the fleet's newest before it moved past them (never news again); the oldest of
# each are forgotten past this many.
SEEN_VERSIONS_KEPT: Final = 4_096
# A sub-request refused this many times by paused engines (ENGINE_PAUSED, before any output)
# ends with that refusal: each refusal marks its worker paused, so only a worker whose sidecar
# keeps reporting it running while its engine refuses for a pause gets there.
PAUSED_REFUSALS_LIMIT: Final = 30
# How GET /workers lists a serving worker not at the newest version.
PENDING: Final = "pending"


class EngineState(enum.Enum):
    """The engine's state as its sidecar last reported it."""

    UNKNOWN = "unknown"  # its sidecar does not say (older than the field), or not reported yet
    RUNNING = "running"
    PAUSED = "paused"


@dataclass(frozen=True)
class FleetSettings:
    """``--route-latest-weights`` and ``--paused-hold-secs``."""

    # New requests only to the workers at the newest weight version.
    route_latest_weights: bool = False
    # How long a request waits while its model's fleet is held (every worker paused, or none at
    # the newest version) before it is answered 503.
    paused_hold: float = DEFAULT_PAUSED_HOLD_SECS

    def __post_init__(self) -> None:
        if not self.paused_hold >= 0.0:
            raise ValueError(f"paused_hold is at least 0, got {self.paused_hold}")


def takes_new(*, eligible: bool, paused: bool, current: bool) -> bool:
    """Whether a worker takes a new request: it is eligible (serving, not ejected), its engine
    is not paused, and it is at the newest version (``current``, see :meth:`WeightVersions.current`)."""
    return eligible and not paused and current


def held(*, eligible: int, taking_new: int) -> bool:
    """Whether a model's requests wait: ``eligible`` of its workers serve (they are not down)
    but none of them (``taking_new``) takes a new request."""
    return eligible > 0 and taking_new == 0


def placement_wait(worker_wait: float, paused_hold: float, *, fleet_held: bool) -> float:
    """How long an attempt may wait for a worker: ``worker_wait`` (0 for a first attempt, the
    retries' wait for a worker to come back) unless the fleet is held, then the pause's hold."""
    return max(worker_wait, paused_hold) if fleet_held else worker_wait


def held_reason(model: str, *, paused: int, pending: int, newest: str | None) -> str:
    """Why ``model``'s requests wait, in words for a log line and a 503: ``paused`` workers
    paused and ``pending`` not at the ``newest`` version (among those not paused)."""
    if pending and newest is not None:
        behind = f"{pending} not at the newest weight version {newest!r} (--route-latest-weights)"
        return f"no worker of {model} takes new requests: {paused} paused, {behind}"
    return f"every worker of {model} is paused ({paused})"


def listed_state(state: str, *, paused: bool, current: bool) -> str:
    """The ``state`` GET /workers lists for a worker in ``state`` (the registry's value): a
    serving worker is ``paused`` while its engine is, else ``pending`` while it is not at the
    newest version; any other state is listed as it is."""
    if state != "serving":
        return state
    if paused:
        return EngineState.PAUSED.value
    if not current:
        return PENDING
    return state


@dataclass(frozen=True)
class VersionNews:
    """What one change did to the fleet's versions (the caller logs it)."""

    newest_changed: bool = False
    # The fleet went from one version to several (True), from several to one (False), or
    # neither (None).
    mixed: bool | None = None


class WeightVersions:
    """Each worker's reported version (by address) and the fleet's newest."""

    def __init__(self, *, route_latest_weights: bool = False) -> None:
        self._route_latest = route_latest_weights
        self._of: dict[str, str] = {}
        self._reported: str | None = None
        self._admin: str | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()
        # Versions that were the reported newest and were replaced (never news again).
        self._superseded: OrderedDict[str, None] = OrderedDict()

    @property
    def newest(self) -> str | None:
        """The version set by an admin call, else the newest reported (None: none yet)."""
        return self._admin if self._admin is not None else self._reported

    @property
    def reported(self) -> str | None:
        """The newest version by the workers' reports alone (what an admin call's version hides)."""
        return self._reported

    @property
    def set_by_admin(self) -> bool:
        return self._admin is not None

    @property
    def routes_by_version(self) -> bool:
        """Whether new requests go only to workers at the newest version: the flag, or an
        admin call that set a version."""
        return self._route_latest or self._admin is not None

    def version_of(self, address: str) -> str | None:
        return self._of.get(address)

    def current(self, version: str | None) -> bool:
        """Whether a worker at ``version`` (None: it reports none) takes new requests as far as
        versions go: always, unless new requests go by version and a newest is known; then
        only at that version."""
        newest = self.newest
        return not self.routes_by_version or newest is None or version == newest

    def counts(self) -> Counter[str]:
        """How many workers report each version."""
        return Counter(self._of.values())

    @property
    def mixed(self) -> bool:
        return len(set(self._of.values())) > 1

    def report(self, address: str, version: str | None) -> VersionNews:
        """``address`` reported ``version`` (None: its engine's wire does not say, or not
        now): the rules of the module docstring."""
        was_mixed, was_newest = self.mixed, self.newest
        previous = self._of.get(address)
        if version is None:
            self._of.pop(address, None)
            return self._news(was_mixed, was_newest)
        self._of[address] = version
        if self._reported is None:
            news = True
        elif version == self._reported or version in self._superseded:
            news = False
        elif previous is None:
            news = version not in self._seen
        else:
            news = version != previous
        _remember(self._seen, version)
        if news:
            if self._reported is not None:
                _remember(self._superseded, self._reported)
            self._reported = version
        return self._news(was_mixed, was_newest)

    def forget(self, address: str) -> VersionNews:
        """``address`` left, or stopped serving: its version is forgotten (its next report is
        a first one)."""
        was_mixed, was_newest = self.mixed, self.newest
        self._of.pop(address, None)
        return self._news(was_mixed, was_newest)

    def set_admin(self, version: str | None) -> VersionNews:
        """An admin call set the newest version (None: back to the reported one)."""
        was_mixed, was_newest = self.mixed, self.newest
        self._admin = version
        return self._news(was_mixed, was_newest)

    def _news(self, was_mixed: bool, was_newest: str | None) -> VersionNews:
        mixed = self.mixed
        return VersionNews(
            newest_changed=self.newest != was_newest, mixed=mixed if mixed != was_mixed else None
        )


def _remember(versions: OrderedDict[str, None], version: str) -> None:
    """Add ``version`` as the most recent of ``versions``; the oldest go past the bound."""
    versions[version] = None
    versions.move_to_end(version)
    while len(versions) > SEEN_VERSIONS_KEPT:
        versions.popitem(last=False)
