"""The routing decision's CPU cost and the index's memory, in process, through the real
routing module (``sidecar_frontend.routing.router.Router`` with ``routing=kv``).

Decision: every worker publishes blocks of 16 and holds the first half of the prompt; one of
them holds all of it (two prefix lengths for the bisection to find). Measured: the whole
``Router.choose`` of a request message's prompt (``choice.prompt_of``, as the frontend routes:
the token ids a protobuf repeated field), its two parts alone (the keys,
``sidecar_common.kv_keys.block_key_chain``; the walk, ``BlockIndex.match``), and the whole
decision given the token ids as a Python list instead; and the whole decision with routing
``approx`` (no exact entries: each decision stores the prompt's blocks as approximate entries
and expires one earlier store). Each figure is the minimum over rounds
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
from types import ModuleType
from typing import Any

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import block_key_chain, block_keys
from sidecar_frontend.routing import router as router_module
from sidecar_frontend.routing.choice import prompt_of

__all__ = ["best_us", "calls_per_round", "decision_cost", "decision_setup", "index_memory"]

BLOCK = 16


def best_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e6


def decision_setup(
    prompt_tokens: int, workers: int, routing: ModuleType = router_module
) -> dict[str, Callable[[], object]]:
    """The calls the decision figures time, over the router of ``routing`` (a module defining
    what ``sidecar_frontend.routing.router`` does: ``bench.kv_routing.ab`` passes the same
    module at another commit). Keys: ``whole``, ``from_list``, ``keys``, ``walk`` (routing
    ``kv``, as the module's docstring says) and ``approx`` (routing ``approx``: each decision
    also stores the prompt's blocks as approximate entries, and the clock moves on so that one
    earlier store expires per decision, as in a steady stream of requests)."""
    rng = random.Random(prompt_tokens * 131 + workers)
    tokens = [rng.randrange(1_000, 30_000) for _ in range(prompt_tokens)]
    router = routing.Router(
        routing.RouterConfig(routing=routing.Routing.KV), block_key_chain, random.Random(1)
    )
    index = router.index("m")
    keys = block_keys(tokens, BLOCK)
    addresses = [f"10.0.0.{i}:50051" for i in range(workers)]
    for i, address in enumerate(addresses):
        index.store(address, keys if i == 0 else keys[: len(keys) // 2])
    targets = [
        routing.Target(a, block_size=BLOCK, publishes=True, running=i % 3) for i, a in enumerate(addresses)
    ]
    # As the frontend routes: from the request message it sends (its token ids a protobuf
    # repeated field, which numpy reads natively), through the choice's own prompt_of.
    request = sidecar_pb2.PreprocessedRequest(token_ids=tokens)
    prompt = prompt_of(request)
    listed = routing.Prompt(tokens)
    lookable = keys[: (prompt_tokens - 1) // BLOCK]
    decision = router.choose("m", prompt, targets, 0.0)
    if decision is None or decision.worker != addresses[0]:
        raise RuntimeError(f"the worker holding the whole prompt was not chosen: {decision}")

    # approx: about 16 approximate stores live at a time (a TTL of 16 steps of the clock).
    step = 1.0
    approx = routing.Router(
        routing.RouterConfig(routing=routing.Routing.APPROX, approx_ttl=16 * step),
        block_key_chain,
        random.Random(1),
    )
    approx_targets = [
        routing.Target(a, block_size=BLOCK, publishes=False, running=i % 3) for i, a in enumerate(addresses)
    ]
    clock = [0.0]

    def whole() -> object:
        return router.choose("m", prompt_of(request), targets, 0.0)

    def from_list() -> object:
        return router.choose("m", listed, targets, 0.0)

    def keys_only() -> object:
        return block_key_chain(request.token_ids, BLOCK)

    def walk_only() -> object:
        return index.match(lookable, addresses)

    def approx_decision() -> object:
        clock[0] += step
        return approx.choose("m", prompt_of(request), approx_targets, clock[0])

    return {
        "whole": whole,
        "from_list": from_list,
        "keys": keys_only,
        "walk": walk_only,
        "approx": approx_decision,
    }


def calls_per_round(call: Callable[[], object], budget_s: float) -> int:
    """As many calls per round as fit in about ``budget_s``, so short calls are not clock noise."""
    started = time.process_time()
    call()
    one = max(time.process_time() - started, 1e-6)
    return max(1, min(2000, int(budget_s / one)))


def decision_cost(
    prompt_tokens: int, workers: int, rounds: int = 5, budget_s: float = 0.05
) -> dict[str, Any]:
    calls = decision_setup(prompt_tokens, workers)
    per_round = calls_per_round(calls["whole"], budget_s)
    return {
        "prompt_tokens": prompt_tokens,
        "workers": workers,
        "choose_us": round(best_us(calls["whole"], per_round, rounds), 1),
        "choose_from_list_us": round(best_us(calls["from_list"], per_round, rounds), 1),
        "keys_us": round(best_us(calls["keys"], per_round, rounds), 1),
        "walk_us": round(best_us(calls["walk"], per_round, rounds), 1),
        "approx_choose_us": round(best_us(calls["approx"], per_round, rounds), 1),
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
