"""A trainer-like client of the frontend (the I/O; ``rollout_checks.py`` judges what it records).

It does what slime or SkyRL do to a rollout fleet: many concurrent agent sessions, each a chain
of non-streaming SGLang ``/generate`` turns with ``input_ids`` (turn k's prompt is the previous
prompt, the previous output and a few new ids: the environment's reply), named by
``X-SMG-Routing-Key`` and asking to be resumed after an abort (``X-Resume-On-Abort: true``),
each asking for its routed experts from where the previous turn ended; and a pauser that, every
few seconds, pauses every engine at the engine (SGLang's ``/pause_generation``, each mode in
turn), sets a new weight version on each (``/update_weight_version`` without aborting) and
continues them. Every time recorded is ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.process.rollout_checks import Published, TurnRecord

__all__ = ["Rollout", "RolloutSettings", "run_rollout"]

RESUME_HEADER = "X-Resume-On-Abort"
SESSION_HEADER = "X-SMG-Routing-Key"


@dataclass(frozen=True)
class RolloutSettings:
    sessions: int = 500
    max_new_tokens: int = 12
    first_prompt_ids: int = 8
    new_ids_per_turn: int = 4
    # The environment's step between two turns of a session (an agent's tool call), drawn
    # uniformly from this range: it sets how many turns the rollout sends per second.
    think_secs: tuple[float, float] = (1.0, 2.0)
    # A bound on each session's turns, whatever the pace.
    max_turns: int = 30
    pause_every_secs: float = 5.0
    # One cycle per mode: pause every engine in it, update every version, continue every one.
    pause_modes: tuple[str, ...] = ("abort", "retract", "in_place", "abort")
    # Traffic goes on this long after the last continue, then each session ends its turn.
    after_last_cycle_secs: float = 2.0
    request_timeout_secs: float = 300.0
    seed: int = 28


@dataclass
class Rollout:
    """What the trainer did and saw."""

    turns: list[TurnRecord] = field(default_factory=list)
    published: list[Published] = field(default_factory=list)
    # Each engine call of the pauser that did not answer 200, in words.
    pauser_problems: list[str] = field(default_factory=list)


def _ids(rng: random.Random, count: int) -> list[int]:
    # Ordinary ids (100 and up): no special id, no EOS trigger.
    return [rng.randrange(100, 32000) for _ in range(count)]


async def _session(
    http: aiohttp.ClientSession,
    frontend: str,
    name: str,
    settings: RolloutSettings,
    stop: asyncio.Event,
    rollout: Rollout,
) -> None:
    rng = random.Random(f"{settings.seed}:{name}")
    prompt = _ids(rng, settings.first_prompt_ids)
    experts_start = 0
    for turn in range(settings.max_turns):
        if stop.is_set():
            return
        rid = f"{name}-t{turn}"
        body = {
            "rid": rid,
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": settings.max_new_tokens, "ignore_eos": True},
            "return_routed_experts": True,
            "routed_experts_start_len": experts_start,
        }
        headers = {SESSION_HEADER: name, RESUME_HEADER: "true"}
        sent_at = time.monotonic()
        try:
            async with http.post(frontend + "/generate", json=body, headers=headers) as response:
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as err:
            status, text = 0, f"{type(err).__name__}: {err}"
        answered_at = time.monotonic()
        try:
            answer: Any = json.loads(text)
        except ValueError:
            answer = text
        rollout.turns.append(
            TurnRecord(
                name,
                turn,
                rid,
                tuple(prompt),
                settings.max_new_tokens,
                experts_start,
                sent_at,
                answered_at,
                status,
                answer,
            )
        )
        output = answer.get("output_ids") if isinstance(answer, dict) else None
        if status != 200 or not isinstance(output, list):
            return  # the conversation cannot go on; the checks report the turn
        # The next turn asks for the experts of what it adds: its prompt starts with this sequence.
        experts_start = len(prompt) + len(output)
        prompt = [*prompt, *output, *_ids(rng, settings.new_ids_per_turn)]
        await asyncio.sleep(rng.uniform(*settings.think_secs))


async def _call_each(
    http: aiohttp.ClientSession, engines: Sequence[str], path: str, body: object, rollout: Rollout
) -> None:
    """POST ``path`` to every engine at once; a refusal is recorded."""

    async def one(engine: str) -> None:
        try:
            async with http.post(engine + path, json=body) as response:
                status, text = response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as err:
            status, text = 0, f"{type(err).__name__}: {err}"
        if status != 200:
            rollout.pauser_problems.append(f"{engine}{path} {body}: {status} {text[:300]}")

    await asyncio.gather(*(one(engine) for engine in engines))


async def _pauser(
    http: aiohttp.ClientSession, engines: Sequence[str], settings: RolloutSettings, rollout: Rollout
) -> None:
    started = time.monotonic()
    for cycle, mode in enumerate(settings.pause_modes, start=1):
        await asyncio.sleep(max(0.0, started + cycle * settings.pause_every_secs - time.monotonic()))
        await _call_each(http, engines, "/pause_generation", {"mode": mode}, rollout)
        version = f"v{cycle}"
        asked_at = time.monotonic()
        update = {"new_version": version, "abort_all_requests": False}
        await _call_each(http, engines, "/update_weight_version", update, rollout)
        rollout.published.append(Published(version, asked_at, time.monotonic()))
        await _call_each(http, engines, "/continue_generation", {}, rollout)


async def run_rollout(frontend: str, engines: Sequence[str], settings: RolloutSettings) -> Rollout:
    """The sessions through ``frontend`` while the pauser cycles ``engines``; returns once the
    last cycle is past, traffic went on ``after_last_cycle_secs`` and every session ended."""
    rollout = Rollout()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)  # every session at once, as a trainer's client
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_secs)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        sessions = [
            asyncio.create_task(_session(http, frontend, f"s{i}", settings, stop, rollout))
            for i in range(settings.sessions)
        ]
        try:
            await _pauser(http, engines, settings, rollout)
            await asyncio.sleep(settings.after_last_cycle_secs)
            stop.set()
            await asyncio.gather(*sessions)
        finally:
            for task in sessions:
                task.cancel()
    return rollout
