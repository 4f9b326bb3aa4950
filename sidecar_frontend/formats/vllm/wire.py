"""How the vLLM format writes JSON: as vLLM's server does, compact (no spaces), non-ASCII
text as is, and never a NaN or an infinity (JSON has none; a value that would need one is a
bug upstream, raised here rather than written)."""

from __future__ import annotations

import json

__all__ = ["compact_json"]


def compact_json(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
