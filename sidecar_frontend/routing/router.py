"""The routing policy of the frontend: one block index per model, the choice of a worker (pure).

``--routing`` (:class:`Routing`):

* ``kv``: a worker's entries in the index come from its cache stream (exact); a worker that
  publishes no cache state has none, and competes on load alone;
* ``approx``: the index is built from this frontend's own decisions (a request sent to a worker
  is assumed cached there for ``approx_ttl`` seconds), whatever the workers publish;
* unset (the default): ``kv`` for the workers that publish their cache, ``approx`` for the
  others, in one index;
* ``load``, ``round-robin``, ``random``: no index. ``load`` is the worker set's power of two
  choices (``WorkerSet.pick``), not decided here.

A request's keys are ``block_keys(token ids, block size, lora, salt)`` per block size among
the candidates (workers of one model may run different block sizes). An engine computes at
least the last prompt token itself (both vLLM and SGLang cap a prefix hit at the prompt length
minus one), so the cached prefix is looked up over the full blocks of the prompt without its
last token, while an approximate entry records every full block of the prompt.

No I/O and no clock: the caller passes the time and a seeded ``random.Random``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

from sidecar_frontend.routing.index import BlockIndex
from sidecar_frontend.routing.policy import Candidate, Decision, PolicyConfig, Reason, choose
from sidecar_frontend.routing.sessions import SessionSettings

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockKeys",
    "Prompt",
    "Router",
    "RouterConfig",
    "Routing",
    "Target",
]

# The block size assumed for a worker whose sidecar reports none (vLLM's default): only the
# frontend's own approximate entries use it, so any fixed size is consistent.
DEFAULT_BLOCK_SIZE: Final = 16


class Routing(enum.Enum):
    KV = "kv"
    APPROX = "approx"
    LOAD = "load"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


class BlockKeys(Protocol):
    """``sidecar_common.kv_keys.block_key_chain`` (or ``block_keys``): the routing keys of the
    full blocks, chained."""

    def __call__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence[int]: ...


@dataclass(frozen=True)
class RouterConfig:
    routing: Routing | None = None  # None: kv where workers publish their cache, else approx
    index_max_bytes: int | None = 256 * 1024 * 1024  # per model
    approx_ttl: float = 120.0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Sticky sessions (sessions.py), whatever the routing.
    sessions: SessionSettings = field(default_factory=SessionSettings)

    def __post_init__(self) -> None:
        if self.approx_ttl <= 0:
            raise ValueError(f"approx_ttl must be positive, got {self.approx_ttl}")

    @property
    def uses_index(self) -> bool:
        return self.routing in (None, Routing.KV, Routing.APPROX)

    @property
    def follows_streams(self) -> bool:
        """Whether the workers' cache streams feed the index."""
        return self.routing in (None, Routing.KV)


class Target(NamedTuple):
    """A candidate worker as the router sees it (a tuple: one is made per worker per decision,
    and a frozen dataclass's __init__ costs about 1.5 µs)."""

    address: str
    block_size: int = 0  # its engine's KV block size (0: not reported)
    publishes: bool = False  # its entries come from its cache stream
    running: int = 0  # requests in flight there (every frontend's)
    queued_prefill_tokens: int = 0  # this frontend's prefill not yet done there


@dataclass(frozen=True)
class Prompt:
    token_ids: Sequence[int]
    lora_name: str | None = None
    cache_salt: str | None = None
    # False for a request whose cache entries depend on more than its tokens (images):
    # routed on load alone, and recorded nowhere.
    cacheable: bool = True


class Router:
    """The indexes (one per model) and the choice among candidate workers."""

    def __init__(
        self, config: RouterConfig, block_keys: BlockKeys, rand: random.Random | None = None
    ) -> None:
        if config.routing is Routing.LOAD:
            raise ValueError("routing 'load' is the worker set's own choice, not a Router's")
        self.config = config
        self._block_keys = block_keys
        self._rand = rand if rand is not None else random.Random()
        self._indexes: dict[str, BlockIndex] = {}
        self._turns: dict[str, int] = {}
        self._sent: dict[str, int] = {}  # decisions per worker address (the policy's tie-break)

    def index(self, model: str) -> BlockIndex:
        """The index of ``model`` (made empty on first use)."""
        found = self._indexes.get(model)
        if found is None:
            found = self._indexes[model] = BlockIndex(self.config.index_max_bytes)
        return found

    def indexes(self) -> Mapping[str, BlockIndex]:
        return self._indexes

    def forget_worker(self, address: str) -> None:
        """``address`` left the set: its entries go from every index, and an index no worker
        is left in goes too."""
        self._sent.pop(address, None)
        for model, index in list(self._indexes.items()):
            index.forget(address)
            if not index.workers():
                del self._indexes[model]

    def retain(self, model_of: Mapping[str, str | None]) -> None:
        """Keep each index to the workers that serve its model now (``model_of``: every
        worker's address -> its served model, None while unknown): a worker that left or now
        serves another model (a rollout reusing its address) loses its entries there, and an
        index no worker is left in goes, so a model rolled out of the fleet keeps neither
        memory nor metric series.

        A worker whose model is unknown for a while (its health watch broke and it has not
        been asked again) keeps its entries: they came from its cache stream, which does not
        send them again, so dropping them would leave the index without that worker's cache
        until its next resync."""
        for address in [a for a in self._sent if a not in model_of]:
            del self._sent[address]
        for model, index in list(self._indexes.items()):
            for worker in index.workers():
                if worker not in model_of or model_of[worker] not in (None, model):
                    index.forget(worker)
            if not index.workers():
                del self._indexes[model]

    def choose(
        self, model: str, prompt: Prompt, targets: Sequence[Target], now: float, *, turn_key: str = ""
    ) -> Decision | None:
        """The worker of ``targets`` to send ``prompt`` to (None: no target). ``turn_key`` names
        the rotation of ``round-robin`` (one per role and model)."""
        if not targets:
            return None
        routing = self.config.routing
        if routing is Routing.ROUND_ROBIN:
            ordered = sorted(targets, key=lambda t: t.address)
            turn = self._turns.get(turn_key, 0)
            self._turns[turn_key] = turn + 1
            return Decision(ordered[turn % len(ordered)].address, Reason.ROUND_ROBIN, 0)
        if routing is Routing.RANDOM:
            return Decision(self._rand.choice(targets).address, Reason.RANDOM, 0)
        tokens = prompt.token_ids
        index = self.index(model)
        index.expire(now)
        keys_by_size: dict[int, Sequence[int]] = {}
        cached = self._cached(index, prompt, targets, keys_by_size)
        sent = self._sent
        # Each candidate made as the tuple it is: Candidate(...) is a Python call (a NamedTuple's
        # __new__), 6 % of an 8k-token decision over 64 workers (bench/README.md, "plain code").
        decision = choose(
            [
                tuple.__new__(
                    Candidate,
                    (
                        t.address,
                        cached.get(t.address, 0),
                        t.running,
                        t.queued_prefill_tokens,
                        sent.get(t.address, 0),
                    ),
                )
                for t in targets
            ],
            len(tokens),
            self._rand,
            self.config.policy,
        )
        if decision is None:
            return None
        self._sent[decision.worker] = self._sent.get(decision.worker, 0) + 1
        if not prompt.cacheable:
            return decision
        chosen = self._recorded(targets, decision.worker)
        if chosen is not None:
            size = _block_size(chosen)
            keys = self._keys(prompt, size, keys_by_size)
            index.store(chosen.address, keys, expires=now + self.config.approx_ttl)
        return decision

    def predicted_cached(self, model: str, prompt: Prompt, targets: Sequence[Target]) -> dict[str, int]:
        """The prompt tokens each of ``targets`` is predicted to hold cached, as :meth:`choose`
        weighs them (a target holding none is left out); read only: nothing is recorded, counted
        or expired. ``round-robin`` and ``random`` predict nothing."""
        if self.config.routing in (Routing.ROUND_ROBIN, Routing.RANDOM):
            return {}
        index = self._indexes.get(model)
        if index is None:
            return {}
        return self._cached(index, prompt, targets, {})

    # ---------------------------------------------------------------- internals

    def _cached(
        self,
        index: BlockIndex,
        prompt: Prompt,
        targets: Sequence[Target],
        keys_by_size: dict[int, Sequence[int]],
    ) -> dict[str, int]:
        """The prompt tokens each target holds cached by ``index`` (none: left out); the keys
        made are kept in ``keys_by_size``."""
        tokens = prompt.token_ids
        cached: dict[str, int] = {}
        if not prompt.cacheable or len(tokens) <= 1:
            return cached
        # approx or unset: every worker is indexed; kv: those publishing their cache.
        routing = self.config.routing
        indexed = targets if routing is not Routing.KV else [t for t in targets if t.publishes]
        sizes: dict[int, list[str]] = {}
        for target in indexed:
            size = target.block_size if target.block_size > 0 else DEFAULT_BLOCK_SIZE
            sizes.setdefault(size, []).append(target.address)
        for size, addresses in sizes.items():
            keys = self._keys(prompt, size, keys_by_size)
            lookable = (len(tokens) - 1) // size
            matched = index.match(keys if lookable == len(keys) else keys[:lookable], addresses)
            for address, blocks in matched.items():
                cached[address] = blocks * size
        return cached

    def _recorded(self, targets: Sequence[Target], worker: str) -> Target | None:
        """The target of ``worker`` when a decision for it becomes an approximate entry, else
        None: always with ``approx``; with routing unset, for a worker whose cache stream says
        nothing; never with ``kv`` (found without looking, on every decision)."""
        routing = self.config.routing
        if routing is Routing.KV:
            return None
        target = next(t for t in targets if t.address == worker)
        return target if routing is Routing.APPROX or not target.publishes else None

    def _keys(self, prompt: Prompt, size: int, memo: dict[int, Sequence[int]]) -> Sequence[int]:
        keys = memo.get(size)
        if keys is None:
            keys = memo[size] = self._block_keys(
                prompt.token_ids, size, lora_name=prompt.lora_name, cache_salt=prompt.cache_salt
            )
        return keys


def _block_size(target: Target) -> int:
    return target.block_size if target.block_size > 0 else DEFAULT_BLOCK_SIZE
