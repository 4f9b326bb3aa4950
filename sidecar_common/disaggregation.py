"""The disaggregation role of a sidecar: a leaf module, so pure conversion can name the type
without importing the daemon's configuration (and through it grpc, anyio and tenacity)."""

from __future__ import annotations

from typing import Literal

__all__ = ["DisaggregationMode"]

DisaggregationMode = Literal["agg", "prefill", "decode"]
