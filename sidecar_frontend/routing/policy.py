"""Which worker a request goes to, weighing its cached prefix against load (pure).

Each candidate worker comes with what the frontend knows of it now (:class:`Candidate`): the
request's cached prefix there (predicted from the block index), the requests it runs (this
frontend's own, exact, plus the other frontends' from its last ``GetLoad``), and the prefill
this frontend has queued there (the uncached prompt tokens of its own requests on that worker
that have not had their first output yet).

The cost of a worker, in prompt tokens to prefill before this request's first token::

    cost = (prompt tokens - cached prefix)      the request's own prefill there
         + queued prefill tokens                 ours, ahead of it
         + running requests * running_request_tokens
         + (best holder's cached prefix - cached prefix) * left_behind_weight

and the cheapest worker wins. The running term stands for everything else a worker is busy with
(decoding, other frontends' prefills) that the frontend can count only in requests. The last
term is what moving a prefix costs beyond this request's own prefill: the prefix is stored a
second time, and its copy takes the room of as many tokens of other prefixes, which are
prefilled again later. Without it a turn of a conversation left the worker holding the
conversation whenever another request's prefill there was about as long as the turn's own, and
the hit was lost for nothing (``python -m bench.kv_routing``, two frontends on multi-turn
conversations: 77.9-79.8 % of hits against one frontend's 80.3-80.8 %; with it, and the
hot-spot slack of 4, 80.0-80.8 % against 80.5-80.8 %: bench/README.md).

Ties go to the worker this frontend has sent the fewest requests, then at random. A prompt no
worker holds any of (a conversation's first turn, a new system prompt) costs the same on every
idle worker; drawn at random, the new prefixes, and with them every later turn that follows its
prefix, pile up unevenly (in ``python -m bench.kv_routing``'s simulation: the busiest of 4
workers served 2.0 times the requests of the least busy on multi-turn conversations, 1.0 with
this rule). Taken in turn, each worker's cache gets its share of them.

Hot-spot guard: a worker running more than ``hot_spot_ratio`` times the requests of the least
busy candidate, plus ``hot_spot_slack``, loses its affinity: it is not chosen until the others
catch up (the least busy worker is never hot, so there is always a choice). Merely zeroing its
cached prefix in the cost would not do: the requests queued there are cheap to prefill *because*
they hit its cache, so it would still look cheapest. Without the guard one popular prefix piles
every request onto the worker holding it; with it that worker takes a bounded share (about
ratio / (ratio + n - 1) of a burst over n equal workers) and the rest spread out, each of them
then caching the prefix too.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Candidate", "Decision", "PolicyConfig", "Reason", "choose"]


class Reason(enum.Enum):
    """Why a worker was chosen (the ``reason`` label of the decisions metric)."""

    AFFINITY = "affinity"  # it holds the longest cached prefix of the request
    LOAD = "load"  # no worker holds any of it, or a less busy worker was worth its prefill
    HOT_SPOT = "hot_spot"  # the worker holding more of it was far busier than the least busy one
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


class Candidate(NamedTuple):
    # A tuple, not a frozen dataclass: a decision makes one per worker, and a frozen
    # dataclass's __init__ costs about 1.5 µs (16 workers: a quarter of a decision).
    worker: str
    cached_tokens: int = 0  # the request's prefix cached there (predicted)
    running: int = 0  # requests in flight there (every frontend's)
    queued_prefill_tokens: int = 0  # this frontend's prefill waiting there
    sent: int = 0  # requests this frontend has sent there (ties go to the fewest)


@dataclass(frozen=True)
class PolicyConfig:
    hot_spot_ratio: float = 1.5
    # 2 fired on noise: the other frontends' running requests are counted from a GetLoad up to a
    # second old (docs/frontend.md, "Hot-spot guard").
    hot_spot_slack: int = 4
    # What one running request weighs against one prompt token to prefill: a decoding request
    # takes a share of every engine step, which a few hundred prompt tokens also take.
    running_request_tokens: int = 128
    # What each cached token left behind weighs, on a worker holding less of the prompt than the
    # best holder does (see the module's docstring).
    left_behind_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.hot_spot_ratio < 1.0:
            raise ValueError(f"hot_spot_ratio must be 1 or more, got {self.hot_spot_ratio}")
        if self.hot_spot_slack < 0 or self.running_request_tokens < 0:
            raise ValueError("hot_spot_slack and running_request_tokens must be 0 or more")
        if not self.left_behind_weight >= 0.0:
            raise ValueError(f"left_behind_weight must be 0 or more, got {self.left_behind_weight}")


class Decision(NamedTuple):  # a tuple for the reason Candidate is one: a frozen dataclass costs 1 µs more
    worker: str
    reason: Reason
    cached_tokens: int  # what the chosen worker is predicted to find cached


def choose(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    rand: random.Random,
    config: PolicyConfig = PolicyConfig(),
) -> Decision | None:
    """The cheapest of ``candidates`` for a prompt of ``prompt_tokens`` (None: no candidate)."""
    if not candidates:
        return None
    least_busy = min(c.running for c in candidates)
    hot_above = config.hot_spot_ratio * least_busy + config.hot_spot_slack
    per_running = config.running_request_tokens
    longest = max(c.cached_tokens for c in candidates)
    # The module's cost less what every candidate pays alike (the prompt, and the best holder's
    # prefix times the weight): each token held there counts 1 + left_behind_weight.
    per_held = 1.0 + config.left_behind_weight
    best_cost = math.inf
    cheapest: list[Candidate] = []
    for candidate in candidates:
        _, cached, running, queued, _ = candidate  # unpacked: cheaper than attribute reads
        if running > hot_above:
            continue
        cost = queued + running * per_running - min(cached, prompt_tokens) * per_held
        if cost < best_cost:
            best_cost = cost
            cheapest = [candidate]
        elif cost == best_cost:
            cheapest.append(candidate)
    if len(cheapest) > 1:
        fewest = min(c.sent for c in cheapest)
        cheapest = [c for c in cheapest if c.sent == fewest]
    chosen = cheapest[0] if len(cheapest) == 1 else rand.choice(cheapest)
    if longest <= 0:
        reason = Reason.LOAD
    elif chosen.cached_tokens >= longest:
        reason = Reason.AFFINITY
    elif any(c.running > hot_above and c.cached_tokens > chosen.cached_tokens for c in candidates):
        reason = Reason.HOT_SPOT
    else:
        reason = Reason.LOAD
    return Decision(chosen.worker, reason, min(chosen.cached_tokens, prompt_tokens))
