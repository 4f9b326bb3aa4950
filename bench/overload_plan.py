"""What the overload benchmark runs: the fleet's shape, its capacity, the load levels and the
arrival schedules (pure: no I/O, no clock; randomness comes from a seeded ``random.Random``).

The fleet is three testkit vLLM engines whose decode step grows with the running batch
(``--token-latency-slope-ms``), each behind its ``sidecar-vllm``. Its capacity in requests per
second follows from the engine settings: every engine runs at most ``max_running`` requests,
and a request holds its slot for its prefill plus ``output_tokens`` decode steps at the full
batch's step time. A calibration run (closed loop, exactly the fleet's slots) checks it.

Loads are multiples of that capacity, sent open loop by a flooding tenant (Poisson arrivals:
nobody waits for an answer before sending the next request) while a quiet tenant sends a
steady request per second on top. In the priority scenario a fixed share of the flood's
requests are marked high priority.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "FLOOD",
    "FULL",
    "HIGH",
    "QUICK",
    "QUIET",
    "Arrival",
    "FleetShape",
    "Profile",
    "Scenario",
    "poisson_times",
    "schedule",
    "steady_times",
]

# The three kinds of request the benchmark tells apart in its figures.
FLOOD: Final = "flood"  # the flooding tenant's ordinary (low-priority) requests
QUIET: Final = "quiet"  # the quiet tenant's steady requests
HIGH: Final = "high"  # the flooding tenant's high-priority requests (priority scenario only)

Kind = Literal["flood", "quiet", "high"]
Scenario = Literal["flood", "priority"]


@dataclass(frozen=True)
class FleetShape:
    """The engines' settings, the requests' shape, and the capacity they imply.

    The defaults (bench/README.md, "Overload", says why): 6 running requests per engine, a
    40 ms decode step alone growing by 3 ms per further running request (55 ms at 6), 48
    output tokens after a 128-token prompt prefilled at 50 µs a token, and an engine queue of
    6 waiting requests past which vLLM refuses (``--max-num-queued-reqs`` = running + queue).
    """

    workers: int = 3
    max_running: int = 6
    engine_queue: int = 6
    token_latency_ms: float = 40.0
    slope_ms: float = 3.0
    prefill_us_per_token: float = 50.0
    prompt_tokens: int = 128
    output_tokens: int = 48

    def step_secs(self, running: int) -> float:
        """One decode step with ``running`` requests in the batch (testkit.pacing's line)."""
        return (self.token_latency_ms + self.slope_ms * max(0, running - 1)) / 1000.0

    @property
    def prefill_secs(self) -> float:
        return self.prompt_tokens * self.prefill_us_per_token / 1e6

    @property
    def service_secs(self) -> float:
        """How long a request holds its slot when every slot of its engine is taken."""
        return self.prefill_secs + self.output_tokens * self.step_secs(self.max_running)

    @property
    def idle_ttft_secs(self) -> float:
        """The engine's share of an idle fleet's time to first token (prefill, one step alone)."""
        return self.prefill_secs + self.step_secs(1)

    @property
    def slots(self) -> int:
        return self.workers * self.max_running

    @property
    def capacity_rps(self) -> float:
        """Requests per second the fleet completes with every slot busy."""
        return self.slots / self.service_secs

    @property
    def max_num_queued_reqs(self) -> int:
        """vLLM's ``--max-num-queued-reqs`` counts unfinished requests, running ones included."""
        return self.max_running + self.engine_queue


@dataclass(frozen=True)
class Profile:
    """How long and at which loads: ``--quick`` is a smoke test, the full run fits 10 minutes."""

    name: str
    loads: tuple[float, ...]  # multiples of the fleet's capacity sent by the flooding tenant
    duration_s: float  # arrivals of one load level
    warmup_s: float  # the first seconds of a level (queues filling) are not measured
    baseline_s: float  # the quiet tenant alone on an idle fleet
    calibration_s: float  # closed loop at the fleet's slots (its first warmup_s not measured)
    drain_s: float  # after a level's last arrival, how long its streams may still run
    quiet_rps: float = 1.0
    high_fraction: float = 0.05


FULL: Final = Profile(
    name="full", loads=(0.5, 1.0, 2.0, 4.0, 8.0), duration_s=16.0, warmup_s=2.0, baseline_s=12.0,
    calibration_s=10.0, drain_s=60.0,
)  # fmt: skip
QUICK: Final = Profile(
    name="quick", loads=(1.0, 4.0), duration_s=3.0, warmup_s=0.5, baseline_s=2.0,
    calibration_s=3.0, drain_s=30.0,
)  # fmt: skip


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the level's start
    kind: Kind


def poisson_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second within ``[0, duration_s)``."""
    if rate <= 0:
        return []
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def steady_times(rate: float, duration_s: float, phase: float) -> list[float]:
    """One arrival every ``1 / rate`` seconds, the first at ``phase`` of an interval (0..1)."""
    if rate <= 0:
        return []
    interval = 1.0 / rate
    slots = math.ceil(duration_s / interval) + 1
    return [t for t in ((phase + i) * interval for i in range(slots)) if t < duration_s]


def schedule(
    flood_rps: float,
    quiet_rps: float,
    duration_s: float,
    scenario: Scenario,
    high_fraction: float,
    rng: random.Random,
) -> list[Arrival]:
    """A level's arrivals in time order: the flood (in the priority scenario one of every
    ``1 / high_fraction`` of its requests, from a random one on, high priority: a short level
    never lacks them by chance) and the quiet tenant's steady requests, at a random phase so
    that they fall at no fixed point of the flood."""
    every = max(1, round(1 / high_fraction)) if high_fraction > 0 else 0
    first = rng.randrange(every) if every else 0
    arrivals: list[Arrival] = []
    for i, at in enumerate(poisson_times(flood_rps, duration_s, rng)):
        high = scenario == "priority" and every > 0 and (i - first) % every == 0
        arrivals.append(Arrival(at, HIGH if high else FLOOD))
    arrivals += [Arrival(at, QUIET) for at in steady_times(quiet_rps, duration_s, rng.random())]
    return sorted(arrivals, key=lambda a: a.at_s)
