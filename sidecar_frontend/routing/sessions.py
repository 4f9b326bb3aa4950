"""Sticky sessions (docs/frontend.md, "Sessions"), pure: the table of the sessions this
frontend process holds, and where a session's turn goes. No I/O, no clock: the caller passes
the time as ``now``.

A session is a client's name for the turns of one conversation or agent trajectory, carried by
a request header: SMG's ``X-SMG-Routing-Key`` (slime, Miles) or vllm-router's ``X-Session-ID``
(SkyRL, prime-rl); :func:`session_of` reads it. Its turns go to one worker, whose KV cache holds
the conversation so far:

* a new session starts on the least loaded candidate worker, the load being the sessions this
  table holds there (what SkyRL's sticky-least-loaded router counts): among the candidates
  holding at most ``spread`` sessions more than the least loaded, the one the router's index
  predicts holds the longest prefix of the turn's prompt (KV-aware routing as the tie-break),
  then the one with the highest rendezvous weight of the session's id and the worker's address
  (:func:`rendezvous_weight`), the same in every process and frontend;
* a turn stays on its session's worker unless that worker is *saturated*: running at least
  ``saturation`` times its running limit (:func:`saturated`; the requests every frontend runs
  there, against the engine's max_num_seqs / max_running_requests or ``--worker-capacity``),
  while another candidate is not: then it moves, as a new session would start but never to a
  saturated worker while an unsaturated one is left;
* a turn whose worker failed it (the attempt runner excludes that worker) or no longer serves
  (ejected, draining, gone, serving another model) moves too.

The table (:class:`SessionTable`) is bounded: past ``max_sessions`` the least recently used
session is forgotten; a session idle for ``idle`` seconds expires. A forgotten session's next
turn starts it anew.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

__all__ = [
    "DEFAULT_SESSION_HEADERS",
    "MAX_SESSION_ID_BYTES",
    "MOVES",
    "Candidate",
    "Reason",
    "Session",
    "SessionKey",
    "SessionSettings",
    "SessionTable",
    "Turn",
    "choose_worker",
    "decide",
    "keep_or_move",
    "rendezvous_weight",
    "running_limit",
    "saturated",
    "session_of",
]

# SMG's header (slime, Miles; its manual and consistent_hashing policies) and vllm-router's
# (SkyRL, prime-rl; its sticky_least_loaded and consistent_hash policies), lower-cased: HTTP
# header names are case-insensitive.
DEFAULT_SESSION_HEADERS: Final = ("x-smg-routing-key", "x-session-id")
# A longer session id is routed as a request without one (PrimeIntellect's vllm-router fork does
# the same): the table's memory stays bounded by max_sessions ids of at most this size.
MAX_SESSION_ID_BYTES: Final = 256

# A session as the table keys it: the role of the workers it sticks to ("agg" or "prefill")
# and the client's id. A model served disaggregated sticks its prefill leg; its decode leg is
# chosen by load, as every decode step is (its prompt comes from the prefill worker).
SessionKey = tuple[str, str]


@dataclass(frozen=True)
class SessionSettings:
    enabled: bool = True
    # The headers naming a request's session, lower-cased, the first present one wins.
    headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS
    # A session unused this long is forgotten (None: never).
    idle: float | None = 1800.0
    # The most sessions one process holds; past it the least recently used is forgotten.
    max_sessions: int = 100_000
    # A worker running at least this times its running limit is saturated.
    saturation: float = 1.0
    # A new session may start on a worker holding up to this many sessions more than the
    # least loaded one (more: the processes of --processes N agree more often, below).
    spread: int = 0
    # Running limits over what the workers report, by address (--worker-capacity).
    worker_capacity: Mapping[str, int] = field(default_factory=dict)
    # The running limit of a worker that reports none.
    default_running_limit: int = 64
    # A turn whose worker is paused by its trainer, or behind the fleet's newest weight
    # version, waits this long for it to take new requests before moving (a fleet's engines
    # continue, and report their new version, a moment apart).
    pause_wait: float = 10.0

    def __post_init__(self) -> None:
        if self.idle is not None and not self.idle > 0:
            raise ValueError(f"idle must be positive (or None: never), got {self.idle}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if not self.saturation > 0:
            raise ValueError(f"saturation must be positive, got {self.saturation}")
        if not self.pause_wait >= 0:
            raise ValueError(f"pause_wait must be 0 or more, got {self.pause_wait}")
        if self.spread < 0 or self.default_running_limit < 1:
            raise ValueError("spread must be 0 or more and default_running_limit at least 1")
        if self.enabled and not self.headers:
            raise ValueError("sessions need at least one header")


def session_of(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The session a request names: the value of the first of ``names`` it carries that is
    not empty (SMG and vllm-router both ignore an empty one), or None; None too for an id longer
    than :data:`MAX_SESSION_ID_BYTES` (routed without a session). ``headers`` looks names up
    case-insensitively (aiohttp's request headers)."""
    for name in names:
        value = headers.get(name)
        if value:
            return value if len(value.encode()) <= MAX_SESSION_ID_BYTES else None
    return None


# ---------------------------------------------------------------- the table


@dataclass
class Session:
    worker: str
    started: float
    last_used: float
    turns: int = 1


class SessionTable:
    """The sessions of one process, least recently used first; each worker's count kept."""

    def __init__(self, max_sessions: int, idle: float | None) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.idle = idle
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[tuple[SessionKey, Session]]:
        """The sessions, least recently used first."""
        return iter(self._sessions.items())

    def get(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    def held(self, worker: str) -> int:
        """The sessions held on ``worker``."""
        return self._held.get(worker, 0)

    def held_by_worker(self) -> Mapping[str, int]:
        return self._held

    def assign(self, key: SessionKey, worker: str, now: float) -> list[tuple[SessionKey, Session]]:
        """``key``'s turn goes to ``worker`` at ``now``: a new session, or a turn of one (on its
        worker or moved). Returns the sessions forgotten to stay within ``max_sessions``."""
        found = self._sessions.get(key)
        if found is None:
            self._sessions[key] = Session(worker, now, now)
            self._count(worker, 1)
        else:
            if found.worker != worker:
                self._count(found.worker, -1)
                self._count(worker, 1)
                found.worker = worker
            found.last_used = now
            found.turns += 1
            self._sessions.move_to_end(key)
        evicted: list[tuple[SessionKey, Session]] = []
        while len(self._sessions) > self.max_sessions:
            evicted.append(self._pop_oldest())
        return evicted

    def release(self, key: SessionKey) -> Session | None:
        """Forget ``key`` (its client finished it); the session, or None if none was held."""
        found = self._sessions.pop(key, None)
        if found is not None:
            self._count(found.worker, -1)
        return found

    def expire(self, now: float) -> list[tuple[SessionKey, Session]]:
        """Forget every session unused for ``idle`` seconds at ``now``; those forgotten, least
        recently used first. Costs one look at the least recently used session when none is due."""
        idle = self.idle
        expired: list[tuple[SessionKey, Session]] = []
        if idle is None:
            return expired
        sessions = self._sessions
        while sessions:
            oldest = next(iter(sessions.values()))
            if now - oldest.last_used < idle:
                break
            expired.append(self._pop_oldest())
        return expired

    def _pop_oldest(self) -> tuple[SessionKey, Session]:
        key, session = self._sessions.popitem(last=False)
        self._count(session.worker, -1)
        return key, session

    def _count(self, worker: str, change: int) -> None:
        count = self._held.get(worker, 0) + change
        if count:
            self._held[worker] = count
        else:
            del self._held[worker]


# ---------------------------------------------------------------- the decision


class Candidate(NamedTuple):
    """A worker a turn may go to, as the decision sees it."""

    address: str
    sessions: int = 0  # sessions this table holds there
    running: int = 0  # requests in flight there (every frontend's)
    limit: int = 0  # the requests it runs at once (0: none known: never saturated)
    cached_tokens: int = 0  # the turn's prompt prefix the router predicts cached there


class Reason(enum.Enum):
    """Where a session's turn went, and why (the ``reason`` label of the moves metric)."""

    STARTED = "started"  # the session is new (or was forgotten)
    KEPT = "kept"  # its worker took the turn
    SATURATED = "saturated"  # moved: its worker was saturated, another was not
    FAILOVER = "failover"  # moved: its worker failed the turn
    UNAVAILABLE = "unavailable"  # moved: its worker serves no longer (or not this model)


# The reasons that move a session.
MOVES: Final = frozenset({Reason.SATURATED, Reason.FAILOVER, Reason.UNAVAILABLE})


class Turn(NamedTuple):
    worker: str | None  # where the turn goes (None: no candidate)
    reason: Reason
    # What the router predicts cached on the worker the session leaves (a move: left behind).
    left_behind_tokens: int = 0


def running_limit(address: str, reported: int, settings: SessionSettings) -> int:
    """A worker's running limit: ``--worker-capacity``'s, else what its engine reports, else
    the default."""
    override = settings.worker_capacity.get(address)
    if override is not None:
        return override
    return reported if reported > 0 else settings.default_running_limit


def saturated(candidate: Candidate, saturation: float) -> bool:
    """Whether ``candidate`` runs at least ``saturation`` times its running limit."""
    return candidate.limit > 0 and candidate.running >= saturation * candidate.limit


def rendezvous_weight(session: str, address: str) -> int:
    """The session's weight on a worker (highest random weight hashing): a stable hash of both,
    the same in every process (Python's own ``hash`` of a string is not)."""
    digest = hashlib.blake2b(f"{session}\0{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def keep_or_move(
    held: str | None, candidates: Sequence[Candidate], excluded: frozenset[str], saturation: float
) -> Reason:
    """Whether a turn stays on the session's worker ``held`` (KEPT), starts a session (STARTED:
    ``held`` None), or moves and why. ``candidates``: the workers the turn may go to now (none
    of ``excluded``, the workers the attempt runner excluded for this turn)."""
    if held is None:
        return Reason.STARTED
    if held in excluded:
        return Reason.FAILOVER
    own = next((c for c in candidates if c.address == held), None)
    if own is None:
        return Reason.UNAVAILABLE
    if not saturated(own, saturation):
        return Reason.KEPT
    if any(c.address != held and not saturated(c, saturation) for c in candidates):
        return Reason.SATURATED
    return Reason.KEPT  # every other one is saturated too: moving gains nothing


def choose_worker(
    session: str,
    candidates: Sequence[Candidate],
    *,
    saturation: float,
    spread: int = 0,
    avoid: str | None = None,
) -> str | None:
    """Where a session starts (or moves, away from ``avoid``): among ``candidates`` (an
    unsaturated one while there is one), the least loaded within ``spread`` sessions, then the
    longest predicted cached prefix, then the highest rendezvous weight. None: no candidate."""
    pool = [c for c in candidates if c.address != avoid]
    unsaturated = [c for c in pool if not saturated(c, saturation)]
    if unsaturated:
        pool = unsaturated
    if not pool:
        return None
    least = min(c.sessions for c in pool)
    few = [c for c in pool if c.sessions <= least + spread]
    longest = max(c.cached_tokens for c in few)
    if longest > 0:
        few = [c for c in few if c.cached_tokens == longest]
    if len(few) == 1:
        return few[0].address
    return max(few, key=lambda c: (rendezvous_weight(session, c.address), c.address)).address


def decide(
    session: str,
    held: str | None,
    candidates: Sequence[Candidate],
    excluded: frozenset[str] = frozenset(),
    *,
    saturation: float = 1.0,
    spread: int = 0,
    held_cached_tokens: int = 0,
) -> Turn:
    """Where a turn of ``session`` (on ``held``, None: new) goes among ``candidates``
    (:func:`keep_or_move`, then :func:`choose_worker`). ``held_cached_tokens``: what the router
    predicts cached on ``held``, reported as left behind when the session moves."""
    reason = keep_or_move(held, candidates, excluded, saturation)
    if reason is Reason.KEPT:
        return Turn(held, reason)
    avoid = held if reason is Reason.SATURATED else None
    worker = choose_worker(session, candidates, saturation=saturation, spread=spread, avoid=avoid)
    if reason is Reason.STARTED or worker is None:
        return Turn(worker, reason)
    return Turn(worker, reason, held_cached_tokens)
