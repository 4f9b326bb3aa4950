"""How late the engines' KV events are seen (pure: the caller reads its own clock).

One rule for the sidecar's ``sidecar_kv_events_lag_seconds`` and the frontend's
``frontend_kv_events_lag_seconds``: the time a batch was seen minus the engine's time of the
batch (the ``ts`` of its ``KVEventBatch``, ``time.time()`` on the engine's host in vLLM and
SGLang). The two times come from different hosts' clocks, so the lag includes their skew; a
skew that puts the engine ahead would make it negative, and that is counted as 0.
"""

from __future__ import annotations

import math

__all__ = ["events_lag"]


def events_lag(now: float, engine_time: float) -> float:
    """Seconds from ``engine_time`` to ``now`` (both seconds since the Unix epoch), at least 0.

    A difference that is not a finite number (a broken engine clock) also counts as 0, so
    one bad timestamp cannot turn a histogram's sum into infinity or NaN.
    """
    lag = now - engine_time
    return lag if lag > 0 and math.isfinite(lag) else 0.0
