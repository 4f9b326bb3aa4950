"""The overload benchmark's client: vLLM ``/inference/v1/generate`` requests over aiohttp,
streamed, with exact output lengths (``ignore_eos``), sent open loop at a schedule's times
(nobody waits for an answer before sending the next) or, for the calibration, closed loop.

Each request fills in its :class:`~bench.overload_stats.Outcome` as the answer arrives: the
status line (with ``Retry-After`` and ``x-sidecar-refused-reason`` on a refusal), the first
token, the tokens inside the measured window, the finish, an error event.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from bench.overload_plan import HIGH, Arrival
from bench.overload_stats import Outcome

__all__ = [
    "TENANT_HEADER",
    "Client",
    "RequestShape",
]

TENANT_HEADER: Final = "x-gateway-inference-fairness-id"
# Which tenant each kind of request belongs to: the flood's high-priority requests are the
# flooding tenant's own.
TENANTS: Final = {"flood": "flood", "high": "flood", "quiet": "quiet"}
# vLLM's priority: lower is served first, 0 by default.
HIGH_PRIORITY: Final = -1
_VOCAB: Final = (1000, 30000)  # token ids well clear of the testkit's special ones


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    output_tokens: int
    # Whether high-priority requests carry vLLM's ``priority`` (admission on): with admission
    # off nothing would read it, and sidecar-vllm refuses a priority the vLLM wire cannot carry.
    send_priority: bool


class Client:
    def __init__(self, url: str, shape: RequestShape, seed: int) -> None:
        self._url = url + "/inference/v1/generate"
        self._shape = shape
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _body(self, kind: str) -> bytes:
        # A fresh random prompt each time: no request finds another's prefix in an engine's cache.
        prompt = [self._rng.randrange(*_VOCAB) for _ in range(self._shape.prompt_tokens)]
        body: dict[str, Any] = {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": self._shape.output_tokens, "ignore_eos": True},
            "stream": True,
        }
        if kind == HIGH and self._shape.send_priority:
            body["priority"] = HIGH_PRIORITY
        return json.dumps(body).encode()

    async def send(self, outcome: Outcome, t0: float, window: tuple[float, float]) -> None:
        """One request; ``outcome`` is filled in as its answer arrives (``t0``: the level's start)."""
        assert self._session is not None
        clock = time.perf_counter
        headers = {"Content-Type": "application/json", TENANT_HEADER: TENANTS[outcome.kind]}
        body = self._body(outcome.kind)
        sent = clock()
        try:
            async with self._session.post(self._url, data=body, headers=headers) as response:
                outcome.status = response.status
                outcome.answer_s = clock() - t0
                outcome.retry_after = response.headers.get("Retry-After")
                outcome.refused_reason = response.headers.get("x-sidecar-refused-reason")
                if response.status != 200:
                    outcome.failure = f"HTTP {response.status}: {(await response.read())[:160]!r}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = clock()
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.error_event = str(event["error"])[:160]
                        continue
                    for choice in event.get("choices") or ():
                        n = len(choice.get("token_ids") or ())
                        if n and outcome.ttft_s is None:
                            outcome.ttft_s = now - sent
                        outcome.tokens += n
                        if window[0] <= now - t0 < window[1]:
                            outcome.tokens_in_window += n
                        if choice.get("finish_reason") is not None:
                            outcome.finished = True
        except (aiohttp.ClientError, ValueError) as err:
            outcome.failure = f"{type(err).__name__}: {err}"[:200]
        finally:
            outcome.done_s = clock() - t0

    async def open_loop(
        self,
        arrivals: Sequence[Arrival],
        t0: float,
        window: tuple[float, float],
        answer_grace_s: float,
        drain_s: float,
    ) -> list[Outcome]:
        """Send every arrival at its time after ``t0`` (a ``time.perf_counter`` reading). After
        the last one, a request still without an answer ``answer_grace_s`` later leaves (its
        client gives up: an admission queue drops it), and one still streaming ``drain_s``
        later is cancelled; both are marked ``cut``."""
        clock = time.perf_counter
        outcomes: list[Outcome] = []
        tasks: list[asyncio.Task[None]] = []
        for arrival in arrivals:
            delay = arrival.at_s - (clock() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(kind=arrival.kind, scheduled_s=arrival.at_s, sent_s=clock() - t0)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(self.send(outcome, t0, window)))
        if tasks:
            last = clock()
            _, pending = await asyncio.wait(tasks, timeout=answer_grace_s)
            waiting = [t for o, t in zip(outcomes, tasks, strict=True) if o.status is None and not t.done()]
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            pending = {t for t in pending if not t.done()}
            if pending:
                _, pending = await asyncio.wait(pending, timeout=max(0.0, last + drain_s - clock()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for outcome, task in zip(outcomes, tasks, strict=True):
            outcome.cut = task.cancelled()
        return outcomes

    async def closed_loop(
        self, streams: int, duration_s: float, window: tuple[float, float]
    ) -> list[Outcome]:
        """``streams`` streams, each sending its next request when the last one ended, for
        ``duration_s`` (their starts spread over the first second so they do not move in step);
        the requests still running then are waited for."""
        clock = time.perf_counter
        t0 = clock()
        outcomes: list[Outcome] = []

        async def stream(index: int) -> None:
            await asyncio.sleep(index / streams)
            while clock() - t0 < duration_s:
                now = clock() - t0
                outcome = Outcome(kind="flood", scheduled_s=now, sent_s=now)
                outcomes.append(outcome)
                await self.send(outcome, t0, window)
                if not outcome.admitted:
                    await asyncio.sleep(0.05)  # a refused stream must not spin

        await asyncio.gather(*(stream(i) for i in range(streams)))
        return outcomes
