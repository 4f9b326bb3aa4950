"""The connection pool's settings (docs/common.md): plain data, so that a command line can
build them from its flags without importing grpc; the pool itself is
:mod:`sidecar_common.pool`."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar_common.endpoint import Endpoint

__all__ = ["PoolConfig", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    attempt_timeout: float = 30.0  # --grpc-connect-attempt-timeout-secs
    max_interval: float = 1.0  # --grpc-retry-interval-secs (the backoff cap)
    initial_interval: float = 0.05


@dataclass(frozen=True)
class PoolConfig:
    endpoint: Endpoint
    connections: int = 8  # --grpc-connections
    startup_deadline: float = 1800.0  # --grpc-startup-deadline-secs
    retry: RetryPolicy = RetryPolicy()
    # What the pool dials, as its errors name it (the frontend's pools dial workers).
    peer: str = "engine"
