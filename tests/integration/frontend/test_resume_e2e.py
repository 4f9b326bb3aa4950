"""Resume on request, end to end with a testkit SGLang engine paused by its trainer in
``abort`` mode (its real ``/pause_generation``): a request sent with ``X-Resume-On-Abort: true``
goes on after ``/continue_generation`` from the tokens it had, its budget deducted, and the
client gets one answer whose tokens are exactly those of the same request never paused, its
weight-version spans split where the weights changed; without the header the client gets the
engine's own answer (an abort finish with the tokens so far)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import sse_json_events
from tests.integration.frontend.test_fleet_e2e import PROMPT, Fleet, fleet

pytestmark = pytest.mark.timeout(120)

BUDGET = 400
MADE_BEFORE_PAUSE = 20
RESUME = {"X-Resume-On-Abort": "true"}


def _body(stream: bool = False) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True},
        "stream": stream,
    }


def _made(fl: Fleet) -> int:
    book = fl.engines[0].engine.book
    running = book.running_ids()
    held = book.held_tokens(running[0]) if running else None
    return 0 if held is None else held - len(PROMPT)


async def _pause_in_abort_mode_then_update_and_continue(fl: Fleet) -> int:
    """Pause once the engine made some tokens, move its weights to v1, continue: how many tokens
    the engine had made (at least) when it paused."""
    await until(lambda: _made(fl) >= MADE_BEFORE_PAUSE, "the engine made some tokens", secs=60.0)
    made = _made(fl)
    await fl.engine_call(0, "/pause_generation", {"mode": "abort"})
    await fl.set_version(0, "v1")
    await fl.resume(0)
    return made


async def _unpaused_answer(fl: Fleet) -> list[int]:
    async with fl.http.post(fl.url + "/generate", json=_body()) as response:
        assert response.status == 200
        answer = await response.json()
    tokens: list[int] = answer["output_ids"]
    return tokens


async def test_a_request_asking_to_resume_goes_on_after_its_engine_continues() -> None:
    async with fleet(["v0"]) as fl:
        pending = asyncio.ensure_future(fl.http.post(fl.url + "/generate", json=_body(), headers=RESUME))
        made = await _pause_in_abort_mode_then_update_and_continue(fl)
        async with await pending as response:
            assert response.status == 200
            answer = json.loads(await response.read())
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": BUDGET}
        assert meta["completion_tokens"] == BUDGET
        assert answer["output_ids"] == await _unpaused_answer(fl)
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["v0", "v1"]
        split = spans[0]["end"]
        assert split >= made
        assert (spans[0]["start"], spans[1]["start"], spans[1]["end"]) == (0, split, BUDGET)

        # The engine was asked for the rest only: prompt + what it had made, budget deducted.
        bodies = [body for _, body in fl.engines[0].engine.book.received if isinstance(body, dict)]
        first, resumed = bodies[0], bodies[1]
        assert first["input_ids"] == PROMPT
        assert resumed["input_ids"] == PROMPT + answer["output_ids"][:split]
        assert resumed["sampling_params"]["max_new_tokens"] == BUDGET - split


async def test_a_stream_asking_to_resume_goes_on_too() -> None:
    async with fleet(["v0"]) as fl:

        async def read() -> list[dict[str, Any]]:
            async with fl.http.post(
                fl.url + "/generate", json=_body(stream=True), headers=RESUME
            ) as response:
                assert response.status == 200
                return await sse_json_events(response)

        pending = asyncio.ensure_future(read())
        await _pause_in_abort_mode_then_update_and_continue(fl)
        events = await pending
        # SGLang's default stream: each event has every id so far.
        assert events[-1]["output_ids"] == await _unpaused_answer(fl)
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_without_the_header_the_engines_abort_is_the_answer() -> None:
    async with fleet(["v0"]) as fl:
        pending = asyncio.ensure_future(fl.http.post(fl.url + "/generate", json=_body()))
        made = await _pause_in_abort_mode_then_update_and_continue(fl)
        async with await pending as response:
            assert response.status == 200
            answer = json.loads(await response.read())
        assert answer["meta_info"]["finish_reason"]["type"] == "abort"
        assert made <= len(answer["output_ids"]) < BUDGET
        assert answer["output_ids"] == (await _unpaused_answer(fl))[: len(answer["output_ids"])]


async def test_a_bad_header_value_is_refused_naming_it() -> None:
    async with fleet(["v0"]) as fl:
        headers = {"X-Resume-On-Abort": "maybe"}
        async with fl.http.post(fl.url + "/generate", json=_body(), headers=headers) as response:
            assert response.status == 400
            assert "X-Resume-On-Abort" in await response.text()
