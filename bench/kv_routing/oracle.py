"""The best cache hit rate a workload's arrival order allows (pure).

The bound used: one worker with an infinite prefix cache that sees every request in arrival
order. A request finds cached the longest prefix, in whole blocks, that some earlier request
left behind (its prompt and its output but the last token, as vLLM caches them), capped as the
engines cap it: at least the last prompt token is computed, so at most ``(len - 1) // block``
blocks hit. No routing over real workers with finite caches can do better, so "kv within 10 %
of the best possible" is checked against a bound that is, if anything, too strict: it ignores
that a request arriving while the first of its group is still in prefill finds nothing yet.
(Arrival order is the order the client sent the requests; two sent a moment apart may reach
an engine in the other order, so a real run can, rarely, beat the bound by a request.)

Keys come from ``sidecar_common.kv_keys.block_keys``, the chain the fleet itself uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sidecar_common.kv_keys import block_keys

__all__ = ["Bound", "best_hits"]


@dataclass(frozen=True)
class Bound:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def best_hits(requests: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int) -> Bound:
    """``requests``: (prompt token ids, output token ids) in arrival order."""
    seen: set[int] = set()
    prompt_total = 0
    cached_total = 0
    for prompt, output in requests:
        prompt_total += len(prompt)
        lookable = max(0, (len(prompt) - 1) // block_size)
        keys = block_keys(list(prompt) + list(output[:-1]), block_size)
        hit = 0
        for key in keys[:lookable]:
            if key not in seen:
                break
            hit += 1
        cached_total += hit * block_size
        seen.update(keys)
    return Bound(prompt_total, cached_total)
