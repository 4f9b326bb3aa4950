"""The floor of a logprob written as JSON, and the clamp both the vLLM sidecar (prompt
logprobs in ``engine_data``) and the frontend's vLLM format apply (pure).

JSON carries no NaN or infinity, so as vLLM's own server does, a logprob that is not finite
or is below the floor is written as the floor.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["LOGPROB_FLOOR", "clamp_logprob"]

LOGPROB_FLOOR: Final = -9999.0


def clamp_logprob(value: float) -> float:
    """``value``, or :data:`LOGPROB_FLOOR` for NaN, an infinity, or anything below it."""
    if math.isnan(value) or math.isinf(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return value
