"""The routing decision's CPU cost and the index's memory, in process, through the real
routing module (``sidecar_frontend.routing.router.Router`` with ``routing=kv``).

Decision: every worker publishes blocks of 16 and holds the first half of the prompt; one of
them holds all of it (two prefix lengths for the bisection to find). Measured: the whole
``Router.choose`` of a request message's prompt (``choice.prompt_of``, as the frontend routes:
the token ids a protobuf repeated field), its two parts alone (the keys,
``sidecar_common.kv_keys.block_key_chain``; the walk, ``BlockIndex.match``), and the whole
decision given the token ids as a Python list instead. Each figure is the minimum over rounds
of ``time.process_time`` per call (CPU of this process, the least disturbed round on a shared
machine). The index has no cap here, so a match does not reorder it (an index over half its
cap does: about 35 ns a matched block more).

Memory: ``tracemalloc`` over filling an index with chains of 128 blocks, each block held by
one worker (one key and one entry per block), against the index's own estimate
(``BlockIndex.bytes``), scaled to a million blocks.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import block_key_chain, block_keys
from sidecar_frontend.routing.choice import prompt_of
from sidecar_frontend.routing.router import Prompt, Router, RouterConfig, Routing, Target

__all__ = ["decision_cost", "index_memory"]

BLOCK = 16


def _best_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e6


def decision_cost(
    prompt_tokens: int, workers: int, rounds: int = 5, budget_s: float = 0.05
) -> dict[str, Any]:
    rng = random.Random(prompt_tokens * 131 + workers)
    tokens = [rng.randrange(1_000, 30_000) for _ in range(prompt_tokens)]
    router = Router(RouterConfig(routing=Routing.KV), block_key_chain, random.Random(1))
    index = router.index("m")
    keys = block_keys(tokens, BLOCK)
    addresses = [f"10.0.0.{i}:50051" for i in range(workers)]
    for i, address in enumerate(addresses):
        index.store(address, keys if i == 0 else keys[: len(keys) // 2])
    targets = [Target(a, block_size=BLOCK, publishes=True, running=i % 3) for i, a in enumerate(addresses)]
    # As the frontend routes: from the request message it sends (its token ids a protobuf
    # repeated field, which numpy reads natively), through the choice's own prompt_of.
    request = sidecar_pb2.PreprocessedRequest(token_ids=tokens)
    prompt = prompt_of(request)
    listed = Prompt(tokens)
    lookable = keys[: (prompt_tokens - 1) // BLOCK]

    def whole() -> object:
        return router.choose("m", prompt_of(request), targets, 0.0)

    def from_list() -> object:
        return router.choose("m", listed, targets, 0.0)

    def keys_only() -> object:
        return block_key_chain(request.token_ids, BLOCK)

    def walk_only() -> object:
        return index.match(lookable, addresses)

    decision = router.choose("m", prompt, targets, 0.0)
    if decision is None or decision.worker != addresses[0]:
        raise RuntimeError(f"the worker holding the whole prompt was not chosen: {decision}")
    # As many calls per round as fit in about budget_s, so short calls are not clock noise.
    started = time.process_time()
    whole()
    one = max(time.process_time() - started, 1e-6)
    calls = max(1, min(2000, int(budget_s / one)))
    return {
        "prompt_tokens": prompt_tokens,
        "workers": workers,
        "choose_us": round(_best_us(whole, calls, rounds), 1),
        "choose_from_list_us": round(_best_us(from_list, calls, rounds), 1),
        "keys_us": round(_best_us(keys_only, calls, rounds), 1),
        "walk_us": round(_best_us(walk_only, calls, rounds), 1),
    }


def index_memory(blocks: int, workers: int = 4, chain: int = 128) -> dict[str, Any]:
    from sidecar_frontend.routing.index import BlockIndex

    rng = random.Random(7)
    chains = [[rng.getrandbits(64) for _ in range(chain)] for _ in range(blocks // chain)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex(max_bytes=None)
        for i, keys in enumerate(chains):
            index.store(f"w{i % workers}", keys)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The key ints themselves belong to the caller's chains here; in the frontend the index
    # holds the only reference, so the per-key cost includes them (BYTES_PER_KEY does too).
    key_ints = sum(k.__sizeof__() for keys in chains for k in keys)
    stored = len(index)
    scale = 1_000_000 / stored
    return {
        "blocks": stored,
        "workers": workers,
        "tracemalloc_mib_per_million": round((measured + key_ints) * scale / 2**20, 1),
        "estimate_mib_per_million": round(index.bytes * scale / 2**20, 1),
    }
