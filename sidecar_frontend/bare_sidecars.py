"""A bare engine registered through the membership API, and the sidecar the frontend runs for
it (pure: no I/O, no clock, no logging; the processes are :mod:`sidecar_frontend.bare_children`'s).

A trainer that starts bare SGLang or vLLM servers registers them as it would with SMG
(``POST /workers {"url": "http://HOST:PORT"}``); the frontend then runs one sidecar per engine
as its own child, on a loopback port, and routes to that sidecar like any other worker. This
module decides:

- whether a registration can have a managed sidecar here (:func:`bare_refusal`);
- the child's command line and environment (:func:`sidecar_argv`, :func:`child_environment`):
  the same Python installation as the frontend (``sys.executable -m sidecar_sglang``), the
  frontend's log format and level, the role from ``worker_type``, and nothing taken from the
  frontend's ``SIDECAR_*`` variables (they would configure the child behind the flags' back,
  and ``SIDECAR_FRONTEND_ADMIN_TOKEN`` is a secret the child has no use for);
- when a child that exited is started again (:class:`RestartPolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sidecar_frontend.membership import AdminError, Registration

__all__ = [
    "SIDECAR_MODULES",
    "ChildSettings",
    "RestartPolicy",
    "bare_refusal",
    "child_environment",
    "sidecar_argv",
]

# The sidecar each bare engine kind gets, as ``python -m MODULE``.
SIDECAR_MODULES: Final[Mapping[str, str]] = {"sglang": "sidecar_sglang", "vllm": "sidecar_vllm"}
# Variables the child must not inherit: the sidecars read SIDECAR_* as their flags (and the
# frontend's own SIDECAR_FRONTEND_* hold its secrets); NOTIFY_SOCKET is systemd's channel to
# the frontend, which a child writing READY=1 there would speak for.
_PRIVATE_PREFIX: Final = "SIDECAR_"
_PRIVATE_NAMES: Final = frozenset({"NOTIFY_SOCKET"})


@dataclass(frozen=True)
class ChildSettings:
    """What every managed sidecar runs with besides its engine."""

    python: str  # the interpreter (the frontend's sys.executable: the same installation)
    log_format: str  # the frontend's --log-format, passed through
    log_level: str  # the frontend's --log-level, passed through
    host: str = "127.0.0.1"  # the child listens on loopback only: only this frontend dials it


def bare_refusal(registration: Registration, *, worker_tls: bool) -> AdminError | None:
    """Why this frontend cannot run a sidecar for the bare engine of ``registration`` (501),
    or None."""
    kind = registration.engine
    instead = f"start sidecar-{kind} next to the engine and register the sidecar as grpc://HOST:PORT"
    if worker_tls:
        return AdminError(
            501,
            "NOT_IMPLEMENTED",
            f"url {registration.url!r} is a bare {kind} engine: this frontend dials every worker "
            f"over TLS (--worker-tls-ca) and the sidecars it runs serve plaintext on loopback; {instead}",
        )
    return None


def sidecar_argv(registration: Registration, port: int, settings: ChildSettings) -> list[str]:
    """The managed sidecar's command line for the bare engine of ``registration``, serving on
    ``settings.host:port``. SGLang over HTTP (``http://``) uses ``--transport http``; an
    SGLang or vLLM gRPC server (``grpc://`` with ``engine``) is dialled with ``--grpc-endpoint``.
    ``bootstrap_port`` is not passed: the sidecar reads the engine's own from the engine
    (SGLang's ``/server_info`` ``disaggregation_bootstrap_port``)."""
    if registration.engine not in SIDECAR_MODULES:
        raise ValueError(f"{registration.url!r} is a sidecar, not a bare engine")
    argv = [settings.python, "-m", SIDECAR_MODULES[registration.engine]]
    if registration.scheme == "http":
        argv += ["--transport", "http", "--http-endpoint", registration.address]
    else:
        argv += ["--grpc-endpoint", registration.address]
    listen = f"[{settings.host}]" if ":" in settings.host else settings.host
    argv += [
        "--listen",
        f"{listen}:{port}",
        "--disaggregation-mode",
        registration.role,
        "--log-format",
        settings.log_format,
        "--log-level",
        settings.log_level,
    ]
    return argv


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The frontend's environment without what would configure the child behind its flags
    (``SIDECAR_*``) or speak for the frontend (``NOTIFY_SOCKET``)."""
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(_PRIVATE_PREFIX) and name not in _PRIVATE_NAMES
    }


@dataclass(frozen=True)
class RestartPolicy:
    """When a managed sidecar that exited is started again: after ``first_delay``, doubling
    (``factor``) with each exit in a row up to ``max_delay``; a child that ran at least
    ``steady_after`` seconds before it exited starts the count again (it was serving, so this
    exit is a new failure, not the same one repeating)."""

    first_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 30.0
    steady_after: float = 30.0

    def exits_in_a_row(self, before: int, ran_for: float) -> int:
        """The count of exits in a row after one that came ``ran_for`` seconds after its start
        (``before``: the count until then)."""
        return 1 if ran_for >= self.steady_after else before + 1

    def delay(self, exits_in_a_row: int) -> float:
        """How long to wait before the next start, after ``exits_in_a_row`` exits (at least 1)."""
        if exits_in_a_row < 1:
            raise ValueError(f"exits_in_a_row must be at least 1, got {exits_in_a_row}")
        # The exponent is capped so that a long run of failures does not overflow a float.
        exponent = min(exits_in_a_row - 1, 64)
        return min(self.max_delay, self.first_delay * self.factor**exponent)
