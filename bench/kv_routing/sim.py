"""The same comparison as the fleet run, simulated (pure: no processes, no clock, seeded).

Why: the fleet run on a shared 2-core machine measures the machine as much as the policy; this
one measures the policy alone, through the real router (``sidecar_frontend.routing.Router``
for kv, approx, round-robin and random; ``load`` is the frontend's power of two choices on
requests in flight, as ``WorkerSet.pick``), over workers modelled as the fleet's testkit
engines are configured:

* each worker runs one request at a time, first come first served: prefill of the uncached
  prompt tokens at ``prefill_us_per_token``, then ``max_tokens`` at ``token_latency_ms``;
* its prefix cache holds ``capacity_blocks`` blocks of ``block_size``, least recently used
  evicted first; a request finds cached its leading blocks present when it starts (at most
  ``(len - 1) // block`` of them) and leaves its prompt and output blocks when it ends;
* ``kv``: the index learns a worker's stored and evicted blocks when its request's prefill
  ends (the moment an engine publishes ``BlockStored``), with no transport delay;
  ``approx``: the router records its own decisions (TTL 120 s, the frontend's default).

Outputs are synthetic token ids (the engine's answer matters only as tokens the next turn
repeats). Simplifications: evictions are applied when a request ends, not while blocks are in
use (the capacity is never short of one request's blocks here).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.kv_routing.fleet import FleetSpec
from bench.kv_routing.oracle import best_hits
from bench.kv_routing.workloads import Conversation, SharedRequest
from sidecar_common.kv_keys import block_keys
from sidecar_frontend.routing.router import Prompt, Router, RouterConfig, Routing, Target

__all__ = ["SimResult", "simulate_multi_turn", "simulate_shared"]


@dataclass
class SimResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    output_tokens: int = 0
    end_s: float = 0.0
    # (prompt, output) of each request in arrival order (the order serve runs them), for the
    # bound (oracle.best_hits).
    log: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def row(self, block_size: int) -> dict[str, object]:
        ordered = sorted(self.ttft_ms)

        def pct(q: float) -> float | None:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None

        counts = sorted(self.per_worker, reverse=True)
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        best = best_hits(self.log, block_size).hit_rate
        return {
            "requests": sum(counts),
            "hit_rate": round(hit, 4),
            "best_hit_rate": round(best, 4),
            "hit_vs_best": round(hit / best, 3) if best else None,
            "ttft_p50_ms": pct(0.5),
            "ttft_p90_ms": pct(0.9),
            "output_tokens_per_s": round(self.output_tokens / self.end_s, 1) if self.end_s else None,
            "requests_per_worker": counts,
            "spread_max_over_min": round(counts[0] / counts[-1], 2) if counts and counts[-1] else None,
        }


class _Worker:
    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.free_at = 0.0
        self.finishes: deque[float] = deque()  # end times of its requests, in order (FIFO)
        self.prefills: deque[tuple[float, int]] = deque()  # (prefill end, uncached tokens)

    def cached_blocks(self, keys: Sequence[int], lookable: int) -> int:
        hit = 0
        for key in keys[:lookable]:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            hit += 1
        return hit

    def store(self, keys: Sequence[int]) -> list[int]:
        """Blocks evicted to make room."""
        for key in keys:
            self.cache[key] = None
            self.cache.move_to_end(key)
        evicted: list[int] = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return evicted

    def running(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        return len(self.finishes)

    def queued_prefill(self, now: float) -> int:
        while self.prefills and self.prefills[0][0] <= now:
            self.prefills.popleft()
        return sum(tokens for _, tokens in self.prefills)


class _Sim:
    def __init__(self, spec: FleetSpec, policy: str, seed: int) -> None:
        self.spec = spec
        self.policy = policy
        self.rand = random.Random(seed)
        self.workers = [_Worker(f"w{i}", spec.capacity_blocks) for i in range(spec.workers)]
        routing = {"kv": Routing.KV, "approx": Routing.APPROX, "round-robin": Routing.ROUND_ROBIN}
        self.router: Router | None = None
        if policy in routing or policy == "random":
            chosen = routing.get(policy, Routing.RANDOM)
            self.router = Router(RouterConfig(routing=chosen), block_keys, random.Random(seed))
        # (time, order, worker, keys stored, keys evicted): the index learns them at that time.
        self.events: list[tuple[float, int, int, list[int], list[int]]] = []
        self.order = 0
        self.result = SimResult(per_worker=[0] * spec.workers)
        self.out_rand = random.Random(seed + 1)

    def _publish_until(self, now: float) -> None:
        if self.router is None:
            self.events.clear()
            return
        index = self.router.index("m")
        while self.events and self.events[0][0] <= now:
            _, _, w, stored, evicted = heapq.heappop(self.events)
            name = self.workers[w].name
            if self.policy == "kv":  # approx hears nothing from the workers
                index.store(name, stored)
                index.remove(name, evicted)

    def _choose(self, tokens: Sequence[int], now: float) -> int:
        if self.router is None:  # load: the less busy of two drawn at random
            if len(self.workers) == 1:
                return 0
            a, b = self.rand.sample(range(len(self.workers)), 2)
            return b if self.workers[b].running(now) < self.workers[a].running(now) else a
        self._publish_until(now)
        targets = [
            Target(w.name, self.spec.block_size, self.policy == "kv", w.running(now), w.queued_prefill(now))
            for w in self.workers
        ]
        decision = self.router.choose("m", Prompt(tokens), targets, now)
        assert decision is not None
        return int(decision.worker[1:])

    def serve(self, tokens: tuple[int, ...], now: float) -> tuple[float, tuple[int, ...]]:
        """Route and run one request arriving at ``now``: (its end time, its output)."""
        spec = self.spec
        w = self._choose(tokens, now)
        worker = self.workers[w]
        output = tuple(self.out_rand.randrange(1_000, 30_000) for _ in range(spec.max_tokens))
        keys = block_keys(list(tokens) + list(output[:-1]), spec.block_size)
        start = max(now, worker.free_at)
        lookable = (len(tokens) - 1) // spec.block_size
        cached = worker.cached_blocks(keys, lookable) * spec.block_size
        uncached = len(tokens) - cached
        prefill_end = start + uncached * spec.prefill_us_per_token / 1e6
        first_token = prefill_end + spec.token_latency_ms / 1e3
        end = prefill_end + spec.max_tokens * spec.token_latency_ms / 1e3
        worker.free_at = end
        worker.finishes.append(end)
        worker.prefills.append((prefill_end, uncached))
        evicted = worker.store(keys)
        self.order += 1
        heapq.heappush(self.events, (prefill_end, self.order, w, keys, evicted))
        r = self.result
        r.prompt_tokens += len(tokens)
        r.cached_tokens += cached
        r.ttft_ms.append((first_token - now) * 1e3)
        r.per_worker[w] += 1
        r.output_tokens += spec.max_tokens
        r.end_s = max(r.end_s, end)
        r.log.append((tokens, output))
        return end, output


def simulate_shared(
    spec: FleetSpec, policy: str, requests: Sequence[SharedRequest], seed: int = 20
) -> SimResult:
    sim = _Sim(spec, policy, seed)
    for req in requests:
        sim.serve(req.token_ids, req.arrival_s)
    return sim.result


def simulate_multi_turn(
    spec: FleetSpec, policy: str, conversations: Sequence[Conversation], seed: int = 20
) -> SimResult:
    sim = _Sim(spec, policy, seed)
    # (arrival, order, conversation, turn, history so far)
    pending: list[tuple[float, int, int, int, tuple[int, ...]]] = [
        (c.start_s, i, i, 0, c.system) for i, c in enumerate(conversations)
    ]
    heapq.heapify(pending)
    order = len(pending)
    while pending:
        now, _, ci, turn, history = heapq.heappop(pending)
        conv = conversations[ci]
        prompt = history + conv.user_messages[turn]
        end, output = sim.serve(prompt, now)
        if turn + 1 < len(conv.user_messages):
            order += 1
            heapq.heappush(pending, (end, order, ci, turn + 1, prompt + output))
    return sim.result
