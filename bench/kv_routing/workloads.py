"""The benchmark's request streams (pure: seeded, no I/O, no clock).

Token ids are drawn from a range no special token uses, so every prompt is plain text to the
testkit engine. Two shapes:

* shared prefix: ``groups`` distinct prefixes of ``prefix_tokens`` (a long system prompt or a
  document), each request one of them plus its own ``question_tokens``; the group of each
  request is drawn uniformly, arrivals are Poisson at ``rate`` requests per second;
* multi-turn: ``conversations`` each with its own ``system_tokens`` start at Poisson times;
  a turn's prompt is the previous turn's prompt, the engine's answer to it, then a new user
  message of ``user_tokens``. The answer is only known once the previous turn has finished,
  so a conversation's turns are sent one after the other (the runner builds each prompt).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Conversation", "MultiTurn", "SharedPrefix", "SharedRequest", "multi_turn", "shared_prefix"]

_TOKEN_LOW = 1_000
_TOKEN_HIGH = 30_000


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(count))


def _poisson_times(rng: random.Random, count: int, rate: float) -> list[float]:
    times: list[float] = []
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


@dataclass(frozen=True)
class SharedRequest:
    arrival_s: float  # from the start of the run
    group: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SharedPrefix:
    groups: int
    prefix_tokens: int
    question_tokens: int
    requests: int
    rate: float  # requests per second (Poisson)
    seed: int = 20

    @property
    def distinct_prefix_tokens(self) -> int:
        return self.groups * self.prefix_tokens


def shared_prefix(spec: SharedPrefix) -> list[SharedRequest]:
    rng = random.Random(spec.seed)
    prefixes = [_tokens(rng, spec.prefix_tokens) for _ in range(spec.groups)]
    times = _poisson_times(rng, spec.requests, spec.rate)
    out: list[SharedRequest] = []
    for arrival in times:
        group = rng.randrange(spec.groups)
        out.append(SharedRequest(arrival, group, prefixes[group] + _tokens(rng, spec.question_tokens)))
    return out


@dataclass(frozen=True)
class Conversation:
    start_s: float
    system: tuple[int, ...]
    user_messages: tuple[tuple[int, ...], ...]  # one per turn


@dataclass(frozen=True)
class MultiTurn:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    rate: float  # conversations started per second (Poisson)
    seed: int = 20


def multi_turn(spec: MultiTurn) -> list[Conversation]:
    rng = random.Random(spec.seed)
    starts = _poisson_times(rng, spec.conversations, spec.rate)
    return [
        Conversation(
            start,
            _tokens(rng, spec.system_tokens),
            tuple(_tokens(rng, spec.user_tokens) for _ in range(spec.turns)),
        )
        for start in starts
    ]
