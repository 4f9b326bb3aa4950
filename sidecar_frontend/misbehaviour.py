"""A worker is not trusted: what counts as its misbehaviour, the pure checks of its Generate
outputs, and the reporter every part of the frontend tells when a worker misbehaved.

A misbehaving worker (a bug, a version skew, a compromised host) must cost the fleet that one
worker, never the frontend. Each part that reads a worker's replies refuses what does not
decode or is out of range, carries on as for a failed call, and tells the
:class:`MisbehaviourReporter`: ``report(address, kind, detail)``. The reporter logs at error
level once per (worker, kind) per interval (a worker sending garbage on every message must not
flood the log), counts ``frontend_worker_misbehaviour_total{kind}`` every time, and tells its
subscribers (the worker set takes the worker out of routing for a while).

:class:`OutputCheck` is the Generate path's check of each output before the client is given
it (pure: no I/O, no clock, no logging).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from sidecar_common.api import sidecar_pb2

__all__ = [
    "GRPC_DECODE_FAILURE",
    "NO_REPORTS",
    "Fault",
    "Misbehaviour",
    "MisbehaviourReporter",
    "OutputCheck",
    "Reporter",
    "Subscriber",
    "quiet_grpc_decode_failures",
]

log = structlog.get_logger("sidecar_frontend.misbehaviour")


class Misbehaviour(enum.Enum):
    """One kind of misbehaviour (the metric's ``kind`` label, the log line's ``kind``)."""

    # A reply that did not decode (grpc.aio hands the caller None for it), by reply kind.
    UNDECODABLE_OUTPUT = "undecodable_output"
    UNDECODABLE_HEALTH = "undecodable_health"
    UNDECODABLE_MODEL_INFO = "undecodable_model_info"
    UNDECODABLE_LOAD = "undecodable_load"
    UNDECODABLE_KV = "undecodable_kv"
    # A failed call whose status details (google.rpc.Status) or ErrorInfo do not decode.
    UNDECODABLE_STATUS = "undecodable_status"
    # A Generate output's token id at or past the model's vocab_size.
    OUT_OF_VOCAB = "out_of_vocab"
    # A choice that ends LENGTH having generated no token, against a budget above 0.
    EMPTY_LENGTH = "empty_length"
    # An output for a choice the request does not have, or after that choice's terminal.
    BAD_INDEX = "bad_index"
    OUTPUT_AFTER_FINAL = "output_after_final"
    # An output that decodes and passes the checks here, which the HTTP format could not
    # turn into the client's terms (lists of disagreeing lengths, ...).
    UNENCODABLE_OUTPUT = "unencodable_output"
    # GetModelInfo: values no model has (no name, a vocabulary or block size past any bound).
    ABSURD_MODEL_INFO = "absurd_model_info"
    # GetLoad: values no worker can have (negative, NaN, past any bound), or no answer.
    ABSURD_LOAD = "absurd_load"
    HUNG_LOAD = "hung_load"
    # WatchKvCache: a snapshot past the bounds (keys, block size), a gap after every snapshot.
    ABSURD_KV = "absurd_kv"
    KV_RESYNC_STORM = "kv_resync_storm"


@dataclass(frozen=True)
class Fault:
    """A worker's misbehaviour: its kind, and what it sent, in words for the log."""

    kind: Misbehaviour
    detail: str


class OutputCheck:
    """The checks of one sub-request's outputs before the client is given them (pure).

    ``vocab_size`` is the model's (``ModelInfo.vocab_size``; 0: not known, ids unchecked).
    ``request`` is the sub-request as the client asked it (its choices and token budget).
    Fed every output the client is given, across attempts (a continuation's too), in order.
    """

    def __init__(self, request: sidecar_pb2.PreprocessedRequest) -> None:
        options = request.sampling_options
        self.choices = max(options.n, 1) if options.HasField("n") else 1
        stop = request.stop_conditions
        # An empty LENGTH finish is refused only against a budget the request set above 0. A
        # budget of 0 asks for the prompt alone; with none, an engine derives one from its
        # context, and SGLang's scheduler takes min(2**30, max_req_len - prompt - 1), which is
        # 0 for a prompt one or two tokens short of the context it still accepts.
        self.budget_set = stop.HasField("max_tokens") and stop.max_tokens > 0
        self._generated = [0] * self.choices
        self._finished = [False] * self.choices

    def check(self, output: sidecar_pb2.LLMEngineOutput, vocab_size: int) -> Fault | None:
        """The fault in ``output``, or None when it may go to the client (then recorded)."""
        index = output.index
        if index >= self.choices:
            return Fault(Misbehaviour.BAD_INDEX, f"an output for choice {index} of {self.choices}")
        if self._finished[index]:
            return Fault(Misbehaviour.OUTPUT_AFTER_FINAL, f"an output after choice {index}'s terminal")
        ids = output.token_ids
        if ids and vocab_size > 0:
            largest = max(ids)
            if largest >= vocab_size:
                return Fault(Misbehaviour.OUT_OF_VOCAB, f"token id {largest} (vocab_size {vocab_size})")
        generated = self._generated[index] + len(ids)
        finish = output.finish_reason
        if finish == sidecar_pb2.LENGTH and generated == 0 and self.budget_set:
            return Fault(Misbehaviour.EMPTY_LENGTH, f"choice {index} ended LENGTH with no token")
        self._generated[index] = generated
        if finish != sidecar_pb2.UNSPECIFIED:
            self._finished[index] = True
        return None


# Told each report: the worker's address, the kind, the detail.
Subscriber = Callable[[str, Misbehaviour, str], None]


class Reporter(Protocol):
    """Where a part of the frontend tells that a worker misbehaved."""

    def report(self, address: str, kind: Misbehaviour, detail: str) -> None: ...


class _NoReports:
    """Reports go nowhere (a runner built without a reporter)."""

    def report(self, address: str, kind: Misbehaviour, detail: str) -> None:
        del address, kind, detail


NO_REPORTS: Final[Reporter] = _NoReports()

# A worker's (kind) entry is forgotten this many intervals after its last report, so a fleet
# whose workers come and go keeps a bounded table.
_FORGET_AFTER: Final = 4


class MisbehaviourReporter:
    """Logs (rate-limited), counts and fans out each misbehaviour of a worker.

    The first report of a (worker, kind) is logged at error level with ``worker`` and
    ``kind``; later ones within ``interval`` seconds are counted but not logged, and the next
    line after the interval says how many were not (``unlogged``). Every report increments
    ``frontend_worker_misbehaviour_total{kind}`` and is given to every subscriber.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._counter = Counter(
            "frontend_worker_misbehaviour",
            "Replies of workers refused as misbehaviour (undecodable, out of range, a protocol "
            "breach), by kind",
            ["kind"],
            registry=registry,
        )
        self._children = {kind: self._counter.labels(kind=kind.value) for kind in Misbehaviour}
        # (address, kind) -> (when last logged, reports since then not logged)
        self._logged: dict[tuple[str, Misbehaviour], tuple[float, int]] = {}
        self._subscribers: list[Subscriber] = []
        self._swept_at = clock()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Have ``callback`` told every report from now on; returns what unsubscribes it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def report(self, address: str, kind: Misbehaviour, detail: str) -> None:
        self._children[kind].inc()
        now = self._clock()
        self._sweep(now)
        key = (address, kind)
        last = self._logged.get(key)
        if last is None or now - last[0] >= self.interval:
            unlogged = 0 if last is None else last[1]
            self._logged[key] = (now, 0)
            log.error(
                "worker misbehaved",
                worker=address,
                kind=kind.value,
                detail=detail,
                unlogged=unlogged,
                next_log_secs=self.interval,
            )
        else:
            self._logged[key] = (last[0], last[1] + 1)
        for subscriber in tuple(self._subscribers):
            try:
                subscriber(address, kind, detail)
            except Exception as exc:
                # A subscriber's bug must not end the request that reported: logged as one.
                log.error("misbehaviour subscriber failed", worker=address, kind=kind.value, exc_info=exc)

    def _sweep(self, now: float) -> None:
        horizon = self.interval * _FORGET_AFTER
        if now - self._swept_at < horizon:
            return
        self._swept_at = now
        for key, (at, _) in list(self._logged.items()):
            if now - at >= horizon:
                del self._logged[key]


GRPC_DECODE_FAILURE: Final = "Exception deserializing message!"


class _GrpcDecodeFailures(logging.Filter):
    """Drops grpc's own line for a reply that did not decode: a traceback for every such
    message, naming no peer. The frontend reports each such reply itself, with the worker's
    address and rate-limited (``Misbehaviour.UNDECODABLE_*``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != GRPC_DECODE_FAILURE


def quiet_grpc_decode_failures() -> None:
    """Install :class:`_GrpcDecodeFailures` on grpc's logger (once)."""
    logger = logging.getLogger("grpc._common")
    if not any(isinstance(f, _GrpcDecodeFailures) for f in logger.filters):
        logger.addFilter(_GrpcDecodeFailures())
