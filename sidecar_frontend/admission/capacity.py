"""How much the fleet of one model can take now (pure: no I/O, no clock; the time is passed in
as ``now``, on the same clock as each worker's ``reported_at``).

Each worker of the model comes as a :class:`WorkerLoad`: its running limit (the sequences its
engine runs at once), this frontend's own sequences in flight there (exact), and what its
sidecar last reported (the other frontends' sequences, the engine's own queue and KV-cache use,
and when that report arrived). :func:`fleet_room` sums them into a :class:`Room`, which the
admission state (``state.py``) reads as ``free = total_slots - foreign_slots - held slots``,
the held slots being this frontend's own admitted sequences, wherever they run.

The rules, worker by worker:

* its limit is ``running_limit``, or ``CapacitySettings.default_running_limit`` when that is
  0 (not known yet);
* a worker is *stale* when its last report is older than ``stale_after`` seconds
  (``now - reported_at > stale_after``) or when it never reported;
* a fresh worker contributes its limit to ``total_slots`` and the other frontends' sequences
  (``others_requests``) to ``foreign_slots``;
* a fresh worker whose engine is full whatever the counts say (its engine has requests waiting
  in its own queue, or its KV-cache use is at least ``kv_saturated``) contributes its limit and
  ``max(others_requests, limit - own_requests)`` as foreign: no more is admitted to it (its net
  room, ``limit - foreign - own``, is at most 0);
* a stale worker counts as full: it contributes its limit and ``max(0, limit - own_requests)``
  as foreign, so that its net room is 0 (nothing more is admitted for it) while this
  frontend's own sequences already running there are still covered by its slots. (Leaving its
  limit out altogether would charge those sequences against the fresh workers' room.) It is
  counted in ``Room.stale``;
* unless every worker of the list is stale (the reports stopped, not the workers): then each
  counts on this frontend's exact count only, its limit with no foreign slot, so that a fleet
  whose reports stopped is still served.

With ``CapacitySettings.processes`` N above 1 (``sidecar-frontend --processes N``), each process
counts only its share of a worker, ``ceil(limit / N)`` (at least 1), as the worker's limit,
and of the other frontends' sequences (its sibling processes' among them) only those that do
not fit in the rest of the worker, ``max(0, others - (limit - share))``: N processes that
admit within their shares together admit at most the worker's limit (give or take N for the
rounding up), even before the sidecar's next report tells each of the others' sequences. With
N = 1 the share is the limit and every rule above is unchanged.

:func:`worker_has_room` applies the same rules to one worker: ``own + others < limit``, and its
engine not full, and its report fresh. :func:`workers_with_room` does it for a list, with the
every-worker-stale exception (then ``own < limit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CapacitySettings",
    "Room",
    "WorkerLoad",
    "fleet_room",
    "worker_has_room",
    "workers_with_free_slots",
    "workers_with_room",
]


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    # Requests it runs at once (the engine's max_num_seqs / max_running_requests, or a flag's
    # override); 0: not known.
    running_limit: int
    # Sequences this frontend has in flight there (exact).
    own_requests: int
    # Sequences the other frontends have there (from the sidecar's last report).
    others_requests: int
    # Requests waiting in the engine's own queue (last report); None: not known.
    engine_waiting: int | None
    # The engine's KV-cache use, 0..1 (last report); None: not known.
    kv_usage: float | None
    # When the last load report arrived (the caller's clock); None: never.
    reported_at: float | None


@dataclass(frozen=True)
class CapacitySettings:
    # A report older than this (seconds) is stale.
    stale_after: float = 2.0
    # KV-cache use at or above this: the engine takes no new request.
    kv_saturated: float = 0.95
    # The limit of a worker whose running limit is not known (0).
    default_running_limit: int = 64
    # The frontend processes sharing each worker's slots (--processes): each counts its share.
    processes: int = 1


@dataclass(frozen=True)
class Room:
    # The sum of the running limits of the workers counted (each process's share of them with
    # --processes).
    total_slots: int
    # The slots of those workers that this frontend cannot use: the other frontends' sequences,
    # and what a full engine or a stale worker keeps beyond this frontend's own sequences.
    foreign_slots: int
    # Workers counted (every worker of the list).
    workers: int
    # Workers whose report is stale (counted as full, unless every worker is stale).
    stale: int


def fleet_room(loads: Sequence[WorkerLoad], now: float, settings: CapacitySettings) -> Room:
    """The room of a model's fleet (the rules of the module docstring)."""
    stale = sum(1 for load in loads if _is_stale(load, now, settings))
    every_one_stale = stale == len(loads)
    total = 0
    foreign = 0
    for load in loads:
        limit = _limit(load, settings)
        others = _others(load, limit, settings)
        total += limit
        if _is_stale(load, now, settings):
            if not every_one_stale:
                foreign += max(0, limit - load.own_requests)
        elif _engine_full(load, settings):
            foreign += max(others, limit - load.own_requests)
        else:
            foreign += others
    return Room(total_slots=total, foreign_slots=foreign, workers=len(loads), stale=stale)


def worker_has_room(load: WorkerLoad, now: float, settings: CapacitySettings) -> bool:
    """Whether one more sequence may go to this worker: its report is fresh, its engine is not
    full, and ``own + others < limit``."""
    return not _is_stale(load, now, settings) and _has_free_slot(load, settings)


def workers_with_room(
    loads: Sequence[WorkerLoad], now: float, settings: CapacitySettings
) -> list[WorkerLoad]:
    """The workers of ``loads`` that have room (:func:`worker_has_room`), in their order; when
    every one is stale, those whose own count is under their limit."""
    if loads and all(_is_stale(load, now, settings) for load in loads):
        return [load for load in loads if load.own_requests < _limit(load, settings)]
    return [load for load in loads if worker_has_room(load, now, settings)]


def workers_with_free_slots(loads: Sequence[WorkerLoad], settings: CapacitySettings) -> list[WorkerLoad]:
    """The workers of ``loads`` whose counts leave a slot (``own + others < limit``) and whose
    engine was not full at its last report, however old that report is, in their order: where
    routing sends a request admission let in. Staleness is admission's concern (it admits
    nothing for a stale worker); routing that also passed stale workers over would herd every
    request onto the workers whose reports happened to arrive in time (a frontend slowed down
    by its own load reads late reports)."""
    return [load for load in loads if _has_free_slot(load, settings)]


def _has_free_slot(load: WorkerLoad, settings: CapacitySettings) -> bool:
    """Its engine not full by its last report, and ``own + others < limit``."""
    if _engine_full(load, settings):
        return False
    limit = _limit(load, settings)
    return load.own_requests + _others(load, limit, settings) < limit


def _limit(load: WorkerLoad, settings: CapacitySettings) -> int:
    """This process's share of the worker's running limit (the whole limit for one process)."""
    limit = load.running_limit if load.running_limit > 0 else settings.default_running_limit
    return max(1, -(-limit // max(1, settings.processes)))


def _others(load: WorkerLoad, share: int, settings: CapacitySettings) -> int:
    """The other frontends' sequences that reach into this process's share of the worker."""
    if settings.processes <= 1:
        return load.others_requests
    limit = load.running_limit if load.running_limit > 0 else settings.default_running_limit
    return max(0, load.others_requests - (limit - share))


def _is_stale(load: WorkerLoad, now: float, settings: CapacitySettings) -> bool:
    return load.reported_at is None or now - load.reported_at > settings.stale_after


def _engine_full(load: WorkerLoad, settings: CapacitySettings) -> bool:
    waiting = load.engine_waiting is not None and load.engine_waiting > 0
    saturated = load.kv_usage is not None and load.kv_usage >= settings.kv_saturated
    return waiting or saturated
