"""What the engine says of its own state, and what a change of it means (pure: no I/O).

A trainer pauses its engines, updates their weights and lets them continue behind the
router's back (issue 28). The sidecar does not guess that from a failed generation probe: it
asks the engine, on the engine's own wire, at the health watch's cadence
(:mod:`sidecar_server.engine_state_watch`), and puts the answer in every LoadReport. What each
wire can say (docs/api.md, "Engine state"):

* vLLM gRPC: ``GetServerInfo.is_paused``. smg-grpc-servicer 0.14.1 never fills it (always
  false), so a false is believed only once the engine has said true at least once
  (:func:`vllm_paused`): before that the pause state is not known.
* SGLang HTTP: ``GET /ready`` (503 while paused, as while unhealthy) beside ``GET /ping`` (a
  flag check, 200 while paused): :func:`sglang_http_paused`; ``/model_info``'s
  ``weight_version``.
* SGLang gRPC: ``GetModelInfo``'s ``weight_version``; the pause state only on SGLang's
  ``WatchEngineState`` stream, which our mirror of the service does not carry: not known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2

__all__ = [
    "UNKNOWN_STATUS",
    "Change",
    "Continued",
    "EngineStatus",
    "Paused",
    "WeightVersionChanged",
    "changes",
    "last_known",
    "proto_state",
    "sglang_http_paused",
    "vllm_paused",
    "weight_version_of",
]


@dataclass(frozen=True)
class EngineStatus:
    """One reading of the engine's state. ``paused`` None: the wire cannot say (or has not
    yet); ``weight_version`` None: the engine reports none."""

    paused: bool | None = None
    weight_version: str | None = None


UNKNOWN_STATUS: Final = EngineStatus()


@dataclass(frozen=True)
class Paused:
    """The engine says it is paused (it was running, or not known)."""


@dataclass(frozen=True)
class Continued:
    """The engine says it runs again after a pause."""


@dataclass(frozen=True)
class WeightVersionChanged:
    """The engine reports another weight version (``old`` None: the first one known)."""

    old: str | None
    new: str


Change = Paused | Continued | WeightVersionChanged


def changes(known: EngineStatus, after: EngineStatus) -> tuple[Change, ...]:
    """What is worth saying (a log line, a pushed report) when a reading ``after`` follows
    what was ``known`` (:func:`last_known`). A state the wire stops saying is no change:
    nothing was seen to happen."""
    before = known
    found: list[Change] = []
    if after.paused is True and before.paused is not True:
        found.append(Paused())
    elif after.paused is False and before.paused is True:
        found.append(Continued())
    if after.weight_version is not None and after.weight_version != before.weight_version:
        found.append(WeightVersionChanged(before.weight_version, after.weight_version))
    return tuple(found)


def last_known(known: EngineStatus, after: EngineStatus) -> EngineStatus:
    """What is known after the reading ``after``: each of its fields, or the one known before
    where it says nothing (so a pause is said once, however the readings between went)."""
    return EngineStatus(
        after.paused if after.paused is not None else known.paused,
        after.weight_version if after.weight_version is not None else known.weight_version,
    )


def proto_state(paused: bool | None) -> sidecar_pb2.EngineState.ValueType:
    """The LoadReport's ``engine_state`` for a reading's ``paused``."""
    if paused is None:
        return sidecar_pb2.ENGINE_STATE_UNSPECIFIED
    return sidecar_pb2.ENGINE_STATE_PAUSED if paused else sidecar_pb2.ENGINE_STATE_RUNNING


def vllm_paused(is_paused: bool, *, seen_paused: bool) -> bool | None:
    """vLLM's ``GetServerInfo.is_paused`` as a pause state. A servicer that does not fill the
    field answers false whatever the engine does (smg-grpc-servicer 0.14.1), so false means
    running only from an engine that has said true before (``seen_paused``)."""
    if is_paused:
        return True
    return False if seen_paused else None


def sglang_http_paused(ready_status: int, ping_status: int) -> bool | None:
    """SGLang's HTTP pause state from two flag checks: ``/ready`` is 200 when the server takes
    new requests (``not is_pause and is_healthy()``), ``/ping`` 200 when it is healthy, paused
    or not (``tokenizer_manager.is_ready`` and ``is_healthy``). Ready: running; not ready but
    healthy: paused; anything else (starting, unhealthy, an older server without ``/ping``):
    not known, the health watch speaks for it."""
    if ready_status == 200:
        return False
    if ready_status == 503 and ping_status == 200:
        return True
    return None


def weight_version_of(info: Mapping[str, object]) -> str | None:
    """The ``weight_version`` of SGLang's model info (HTTP ``/model_info``, gRPC
    ``GetModelInfo.json_info``), if it reports one as a string."""
    version = info.get("weight_version")
    return version if isinstance(version, str) else None
