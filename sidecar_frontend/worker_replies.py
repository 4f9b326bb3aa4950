"""What a worker's replies may hold before the frontend believes them, and the engine figures a
believed load report gives (pure).

Nothing a worker sends is trusted: a bug, a version skew or a compromised host must cost the
fleet that one worker. Each check answers None for a reply that can be used, or why it cannot,
in words for the log line that names the worker. A reply that did not decode reaches the
frontend as ``None`` (grpc.aio hands the caller ``None`` when deserializing fails) and is
refused as such.

The bounds are far above any real engine's and far below what would cost the frontend memory
or CPU: a load of a million requests, a vocabulary of 16 M ids, a KV block of 64 Ki tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.fleet import MAX_WEIGHT_VERSION_BYTES, EngineState

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_LOAD",
    "MAX_MODEL_NAME_BYTES",
    "MAX_RANKS",
    "MAX_VOCAB_SIZE",
    "UNDECODABLE",
    "EngineLoad",
    "engine_load",
    "engine_state",
    "load_problem",
    "model_info_problem",
]

UNDECODABLE: Final = "the reply did not decode (not a message of its kind)"
MAX_LOAD: Final = 1_000_000
MAX_RANKS: Final = 4_096
MAX_VOCAB_SIZE: Final = 1 << 24
MAX_BLOCK_SIZE: Final = 1 << 16
MAX_MODEL_NAME_BYTES: Final = 1_024


def model_info_problem(info: sidecar_pb2.ModelInfo | None) -> str | None:
    if info is None:
        return UNDECODABLE
    if not info.served_model_name:
        return "its ModelInfo names no model"
    if len(info.served_model_name.encode()) > MAX_MODEL_NAME_BYTES:
        return f"its model name is longer than {MAX_MODEL_NAME_BYTES} bytes"
    if info.vocab_size > MAX_VOCAB_SIZE:
        return f"its vocabulary size {info.vocab_size} is above {MAX_VOCAB_SIZE}"
    if info.kv_block_size > MAX_BLOCK_SIZE:
        return f"its KV block size {info.kv_block_size} is above {MAX_BLOCK_SIZE}"
    return None


def load_problem(report: sidecar_pb2.LoadReport | None) -> str | None:
    if report is None:
        return UNDECODABLE
    if report.inflight_requests > MAX_LOAD:
        return f"its in-flight requests {report.inflight_requests} are above {MAX_LOAD}"
    if len(report.ranks) > MAX_RANKS:
        return f"it reports {len(report.ranks)} ranks, more than {MAX_RANKS}"
    for rank in report.ranks:
        if rank.HasField("running_requests") and rank.running_requests > MAX_LOAD:
            return f"rank {rank.dp_rank} runs {rank.running_requests} requests, more than {MAX_LOAD}"
        if rank.HasField("waiting_requests") and rank.waiting_requests > MAX_LOAD:
            return f"rank {rank.dp_rank} has {rank.waiting_requests} waiting, more than {MAX_LOAD}"
        if rank.HasField("kv_usage") and not (math.isfinite(rank.kv_usage) and 0.0 <= rank.kv_usage <= 1.0):
            return f"rank {rank.dp_rank} reports a KV usage of {rank.kv_usage}, not within [0, 1]"
    if report.kv_cache.block_size > MAX_BLOCK_SIZE:
        return f"its KV block size {report.kv_cache.block_size} is above {MAX_BLOCK_SIZE}"
    if len(report.weight_version.encode()) > MAX_WEIGHT_VERSION_BYTES:
        return f"its weight version is longer than {MAX_WEIGHT_VERSION_BYTES} bytes"
    return None


_ENGINE_STATES: Final = {
    sidecar_pb2.ENGINE_STATE_UNSPECIFIED: EngineState.UNKNOWN,
    sidecar_pb2.ENGINE_STATE_RUNNING: EngineState.RUNNING,
    sidecar_pb2.ENGINE_STATE_PAUSED: EngineState.PAUSED,
}


def engine_state(report: sidecar_pb2.LoadReport) -> tuple[EngineState, str | None]:
    """The engine's state and weight version in a report :func:`load_problem` passed (None: the
    report carries no version). A state a newer sidecar.v1 may add reads as unknown."""
    version = report.weight_version if report.HasField("weight_version") else None
    return _ENGINE_STATES.get(report.engine_state, EngineState.UNKNOWN), version


@dataclass(frozen=True)
class EngineLoad:
    """The engine's own figures in a load report (None where no rank says)."""

    running_requests: int | None
    waiting_requests: int | None
    kv_usage: float | None


def engine_load(report: sidecar_pb2.LoadReport) -> EngineLoad:
    """The figures of a report :func:`load_problem` passed: running and waiting requests summed
    over the ranks that report them, and the fullest rank's KV-cache use (the cautious figure: a
    request placed on the worker may land on that rank)."""
    running = [rank.running_requests for rank in report.ranks if rank.HasField("running_requests")]
    waiting = [rank.waiting_requests for rank in report.ranks if rank.HasField("waiting_requests")]
    usage = [rank.kv_usage for rank in report.ranks if rank.HasField("kv_usage")]
    return EngineLoad(
        running_requests=sum(running) if running else None,
        waiting_requests=sum(waiting) if waiting else None,
        kv_usage=max(usage) if usage else None,
    )
