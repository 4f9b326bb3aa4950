"""The latency bucket ladder of the sidecars' histograms (time to first chunk, between
chunks). The frontend's latency histograms start from the same ladder and extend it to an
hour (sidecar_frontend/metrics.py), so it is defined here, below both."""

from __future__ import annotations

from typing import Final

__all__ = ["LATENCY_BUCKETS"]

# Time to first chunk and between chunks, a millisecond to half a minute.
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
