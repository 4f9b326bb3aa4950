"""Discovery's pure half: flag parsing and the views that turn what DNS or etcd says into
worker-set changes (add this worker with this role, drain that one). No I/O, no clocks.

Both sources end in the same step, :func:`diff_workers`: the worker set is told only what
changed between two complete views (address -> role). An address gone from the view is
drained; a new one, or one whose role changed, is added (``add_worker`` is idempotent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sidecar_common.disaggregation import ROLES, Role, is_role
from sidecar_common.endpoint import HostPort, HostPortError, HostPortWords, format_host_port, parse_host_port
from sidecar_common.registration_record import (
    RecordError,
    WorkerRecord,
    decode_record,
)

__all__ = [
    "AddWorker",
    "Change",
    "DnsTarget",
    "DnsView",
    "DrainWorker",
    "EtcdView",
    "Rejected",
    "diff_workers",
    "missing_workers",
    "parse_dns_target",
    "parse_worker",
]


@dataclass(frozen=True)
class AddWorker:
    address: str
    role: Role


@dataclass(frozen=True)
class DrainWorker:
    address: str


@dataclass(frozen=True)
class Rejected:
    """An etcd value that is not a worker record: ignored, and worth a log line."""

    key: str
    reason: str


Change = AddWorker | DrainWorker | Rejected


def diff_workers(old: Mapping[str, Role], new: Mapping[str, Role]) -> list[Change]:
    """Drains first (capacity leaves before new capacity is counted), then adds, each sorted."""
    changes: list[Change] = [DrainWorker(a) for a in sorted(old.keys() - new.keys())]
    changes += [AddWorker(a, new[a]) for a in sorted(new) if old.get(a) != new[a]]
    return changes


def _role_and_rest(text: str, what: str) -> tuple[Role, str]:
    role_text, sep, rest = text.partition("=")
    if not sep:
        return "agg", text
    if not is_role(role_text):
        raise RecordError(f"{what}: role must be one of {', '.join(ROLES)}, got {role_text!r}")
    return role_text, rest


def _flag_words(what: str) -> HostPortWords:
    brackets = what + ": an IPv6 address needs brackets, e.g. [fd00::1]:50061, got {text!r}"
    return HostPortWords(
        not_host_port=what + ": expected NAME:PORT, got {text!r}",
        brackets=brackets,
        unbracketed_ipv6=brackets,
        bad_host=what + ": not a host name: {detail!r}",
        bad_port=what + ": expected a port in 1..65535, got {detail!r}",
        port_out_of_range=what + ": expected a port in 1..65535, got {detail!r}",
    )


def _host_port(text: str, what: str) -> HostPort:
    try:
        return parse_host_port(text, port_zero_allowed=False)
    except HostPortError as err:
        raise RecordError(_flag_words(what).message(err)) from None


@dataclass(frozen=True)
class DnsTarget:
    """One ``--dns-name [ROLE=]NAME:PORT``: every address NAME resolves to is a worker on PORT."""

    host: str
    port: int
    role: Role = "agg"

    def __str__(self) -> str:
        prefix = "" if self.role == "agg" else f"{self.role}="
        return prefix + format_host_port(self.host, self.port)


def parse_dns_target(text: str) -> DnsTarget:
    role, rest = _role_and_rest(text.strip(), "--dns-name")
    address = _host_port(rest, "--dns-name")
    return DnsTarget(address.host, address.port, role)


def parse_worker(text: str) -> tuple[str, Role]:
    """A static worker ``[ROLE=]HOST:PORT`` -> (address, role)."""
    role, rest = _role_and_rest(text.strip(), "worker")
    return str(_host_port(rest, "worker")), role


@dataclass
class DnsView:
    """The last successful answer for each DNS target; a failed lookup keeps its last answer."""

    targets: tuple[DnsTarget, ...]
    _answers: dict[DnsTarget, frozenset[str]] = field(default_factory=dict)

    def workers(self) -> dict[str, Role]:
        # A worker reachable under two targets keeps the role of the first target listing it.
        found: dict[str, Role] = {}
        for target in self.targets:
            for address in sorted(self._answers.get(target, ())):
                found.setdefault(address, target.role)
        return found

    def resolved(self, target: DnsTarget, hosts: Iterable[str]) -> list[Change]:
        """``target`` now resolves to ``hosts`` (IP addresses); returns the changes."""
        before = self.workers()
        self._answers[target] = frozenset(format_host_port(h, target.port) for h in hosts)
        return diff_workers(before, self.workers())


@dataclass
class EtcdView:
    """The worker records under one etcd prefix, fed a snapshot then watch events.

    Keys are remembered even when their value is bad, so a later delete of such a key is
    silently nothing. Two keys naming the same address count once (the first key, in key
    order, gives the role); the worker goes only when the last of them goes.
    """

    _records: dict[bytes, WorkerRecord | None] = field(default_factory=dict)

    def workers(self) -> dict[str, Role]:
        found: dict[str, Role] = {}
        for key in sorted(self._records):
            record = self._records[key]
            if record is not None:
                found.setdefault(record.address, record.role)
        return found

    def _decode(self, key: bytes, value: bytes, rejected: list[Change]) -> WorkerRecord | None:
        try:
            return decode_record(value)
        except RecordError as err:
            rejected.append(Rejected(key.decode(errors="replace"), str(err)))
            return None

    def resync(self, items: Iterable[tuple[bytes, bytes]]) -> list[Change]:
        """A full listing of the prefix replaces everything known (after a reconnect, this
        is how changes made while etcd was out of reach are caught up)."""
        before = self.workers()
        rejected: list[Change] = []
        self._records = {key: self._decode(key, value, rejected) for key, value in items}
        return rejected + diff_workers(before, self.workers())

    def put(self, key: bytes, value: bytes) -> list[Change]:
        before = self.workers()
        rejected: list[Change] = []
        self._records[key] = self._decode(key, value, rejected)
        return rejected + diff_workers(before, self.workers())

    def delete(self, key: bytes) -> list[Change]:
        before = self.workers()
        self._records.pop(key, None)
        return diff_workers(before, self.workers())


def missing_workers(view: Mapping[str, Role], present: frozenset[str]) -> list[AddWorker]:
    """Workers the view has but the worker set does not (yet, or again: a worker set forgets
    a drained worker only once it is idle, and ignores an add until then)."""
    return [AddWorker(a, view[a]) for a in sorted(view.keys() - present)]
