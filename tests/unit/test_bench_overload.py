"""The overload benchmark's pure parts (bench/overload_plan.py, bench/overload_stats.py): the
capacity it loads the fleet against, the arrivals it sends, and how it turns answers into the
issue's figures and verdicts."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from testkit.pacing import decode_step_secs

from bench.overload import _free_name
from bench.overload_client import TENANT_HEADER, Client, RequestShape
from bench.overload_plan import FLOOD, HIGH, QUIET, Arrival, FleetShape, poisson_times, schedule, steady_times
from bench.overload_stats import Outcome, compare, evaluate, markdown, summarize_level


@pytest.mark.parametrize(
    ("shape", "service", "capacity"),
    [
        # 6 running: a 55 ms step; 6.4 ms prefill + 48 steps = 2.6464 s; 18 slots.
        (FleetShape(), 2.6464, 18 / 2.6464),
        # One slot (a batch of one: the slope never applies), no prefill: 10 steps of 100 ms.
        (
            FleetShape(
                workers=1,
                max_running=1,
                token_latency_ms=100,
                slope_ms=5,
                prefill_us_per_token=0,
                output_tokens=10,
            ),
            1.0,
            1.0,
        ),
        # 4 running: a 40 ms step after a 10 ms prefill; 8 slots.
        (
            FleetShape(
                workers=2,
                max_running=4,
                token_latency_ms=10,
                slope_ms=10,
                prefill_us_per_token=1000,
                prompt_tokens=10,
                output_tokens=5,
            ),
            0.01 + 5 * 0.04,
            8 / 0.21,
        ),
    ],
)
def test_capacity_is_the_slots_over_a_full_batch_request(
    shape: FleetShape, service: float, capacity: float
) -> None:
    assert shape.service_secs == pytest.approx(service)
    assert shape.capacity_rps == pytest.approx(capacity)


@given(st.floats(0, 200), st.floats(0, 20), st.integers(0, 64))
def test_the_step_is_the_testkits_own(latency: float, slope: float, running: int) -> None:
    shape = FleetShape(token_latency_ms=latency, slope_ms=slope)
    assert shape.step_secs(running) == pytest.approx(decode_step_secs(latency, slope, running))


def test_vllms_queue_limit_counts_the_running_requests_too() -> None:
    assert FleetShape(max_running=6, engine_queue=6).max_num_queued_reqs == 12


def test_poisson_arrivals_are_seeded_ordered_and_at_the_rate() -> None:
    times = poisson_times(20.0, 500.0, random.Random(1))
    assert times == poisson_times(20.0, 500.0, random.Random(1))
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < 500.0
    assert len(times) == pytest.approx(20.0 * 500.0, rel=0.03)
    assert poisson_times(0.0, 10.0, random.Random(1)) == []


@pytest.mark.parametrize(
    ("rate", "duration", "phase", "expected"),
    [
        (1.0, 3.0, 0.0, [0.0, 1.0, 2.0]),
        (1.0, 3.0, 0.5, [0.5, 1.5, 2.5]),
        (2.0, 1.0, 0.5, [0.25, 0.75]),
        (1.0, 0.5, 0.9, []),
        (0.0, 10.0, 0.0, []),
    ],
)
def test_steady_arrivals(rate: float, duration: float, phase: float, expected: list[float]) -> None:
    assert steady_times(rate, duration, phase) == pytest.approx(expected)


@given(st.floats(0.1, 50), st.floats(0.1, 100), st.floats(0, 0.999))
def test_steady_arrivals_are_evenly_spaced_inside_the_level(
    rate: float, duration: float, phase: float
) -> None:
    times = steady_times(rate, duration, phase)
    assert all(0 <= t < duration for t in times)
    assert all(b - a == pytest.approx(1 / rate) for a, b in itertools.pairwise(times))
    assert math.floor(duration * rate) <= len(times) <= math.ceil(duration * rate)


def test_the_priority_scenario_marks_a_share_of_the_flood_high() -> None:
    flood = schedule(50.0, 1.0, 100.0, "flood", 0.05, random.Random(3))
    priority = schedule(50.0, 1.0, 100.0, "priority", 0.05, random.Random(3))
    assert not any(a.kind == HIGH for a in flood)
    highs = sum(a.kind == HIGH for a in priority)
    assert abs(highs - sum(a.kind in (HIGH, FLOOD) for a in priority) / 20) <= 1
    for arrivals in (flood, priority):
        assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
        assert sum(a.kind == QUIET for a in arrivals) == 100


def _served(kind: str, sent: float, ttft: float, tokens_in_window: int = 48) -> Outcome:
    return Outcome(kind, sent, sent, status=200, answer_s=sent + 0.001, ttft_s=ttft, done_s=sent + 3,
                   tokens=48, tokens_in_window=tokens_in_window, finished=True)  # fmt: skip


def _refused(sent: float, status: int, reason: str | None, after: float, retry_after: str | None) -> Outcome:
    return Outcome(FLOOD, sent, sent, status=status, answer_s=sent + after, retry_after=retry_after,
                   refused_reason=reason, failure=f"HTTP {status}")  # fmt: skip


@pytest.mark.parametrize(
    ("outcome", "completed", "lost", "refused"),
    [
        (_served(FLOOD, 1, 0.05), True, False, False),
        (Outcome(FLOOD, 1, 1, status=200, tokens=10), False, True, False),  # ended without its finish
        (Outcome(FLOOD, 1, 1, status=200, finished=True, error_event="boom"), False, True, False),
        (Outcome(FLOOD, 1, 1, status=200, failure="ClientPayloadError"), False, True, False),
        (Outcome(FLOOD, 1, 1, status=200, cut=True), False, False, False),  # the bench stopped waiting
        (_refused(1, 429, "queue_full", 0.01, "1"), False, False, True),
        (_refused(1, 503, None, 0.01, None), False, False, True),
        (Outcome(FLOOD, 1, 1, status=400, failure="HTTP 400"), False, False, False),
        (Outcome(FLOOD, 1, 1, failure="ClientConnectorError"), False, False, False),
    ],
)
def test_what_an_outcome_counts_as(outcome: Outcome, completed: bool, lost: bool, refused: bool) -> None:
    assert (outcome.completed, outcome.lost, outcome.refused) == (completed, lost, refused)


def test_a_levels_figures() -> None:
    outcomes = [
        _served(QUIET, 0.5, 0.9),  # before the window: not a TTFT sample, but its tokens count
        _served(QUIET, 2.0, 0.05, tokens_in_window=48),
        _served(QUIET, 3.0, 0.07, tokens_in_window=20),
        _served(HIGH, 2.5, 0.04),
        Outcome(FLOOD, 2.0, 2.0, status=200, ttft_s=0.1, tokens=30, tokens_in_window=30),  # lost: no goodput
        _refused(4.0, 429, "queue_full", 0.010, "1"),
        _refused(4.1, 429, "queue_full", 0.030, "2"),
        _refused(4.2, 429, "queue_timeout", 5.0, "1"),
        _refused(4.3, 503, None, 0.020, None),
        Outcome(FLOOD, 5.0, 5.2, status=400, failure="HTTP 400: bad"),
    ]
    row = summarize_level(outcomes, (1.0, 11.0))
    assert row["sent"] == 10
    assert row["completed"] == 4
    assert row["by_kind"][QUIET]["ttft_samples"] == 2
    assert row["by_kind"][QUIET]["ttft_p99_ms"] == 70.0
    # The slowest measured ones, slowest first, with when each was sent.
    assert row["by_kind"][QUIET]["ttft_slowest"] == [[3.0, 70.0], [2.0, 50.0]]
    assert row["by_kind"][HIGH]["ttft_p50_ms"] == 40.0
    assert row["goodput_tokens_per_s"] == pytest.approx((48 + 48 + 20 + 48) / 10, abs=0.05)
    assert row["refusals"] == {"429 queue_full": 2, "429 queue_timeout": 1, "503 -": 1}
    assert row["refusals_without_retry_after"] == 1
    # The queue timeout waited by design: kept out of the at-once refusals' p99.
    assert row["prompt_refusal_answer_p99_ms"] == 30.0
    assert row["refusal_answer_p99_ms"]["429 queue_timeout"] == 5000.0
    assert row["failures"] == {"400": 1}
    assert row["lost"] == 1
    assert row["lost_samples"] == ["stream ended without its finish"]
    assert row["dispatch_lag_max_ms"] == 200.0


def _row(scenario: str, load: float, goodput: float, quiet_p99: float | None, **extra: Any) -> dict[str, Any]:
    ttfts = [] if quiet_p99 is None else [0.001, quiet_p99 / 1000]
    outcomes = [_served(QUIET, 2.0 + i, t) for i, t in enumerate(ttfts)]
    row = {"scenario": scenario, "load": load, **summarize_level(outcomes, (1.0, 11.0))}
    row.update(goodput_tokens_per_s=goodput, engine_queue_hwm=[0, 1, 2], engine_queue_bound=6)
    row.update(extra)
    return row


def _verdicts(targets: list[Any], load: float) -> dict[str, str]:
    return {t.name: t.verdict for t in targets if t.load == load}


def test_targets_pass_and_fail_row_by_row() -> None:
    baseline = summarize_level([_served(QUIET, 1.0, 0.040), _served(QUIET, 2.0, 0.050)], (0.0, 10.0))
    rows = [
        _row("flood", 1.0, 300.0, 60.0),
        _row("flood", 2.0, 290.0, 75.0),  # 97 % of 1x; 1.5x idle exactly
        _row("flood", 4.0, 280.0, 76.0, engine_queue_hwm=[7, 0, 0]),  # 93 %; over 1.5x; queue over
    ]
    targets = evaluate("on", rows, baseline)
    assert _verdicts(targets, 1.0) == {
        "quiet TTFT p99 <= 1.5x idle": "PASS",
        "refusal answer p99 <= 50 ms": "n/a",
        "Retry-After on every refusal": "n/a",
        "0 admitted requests lost": "PASS",
        "engine queue <= its bound": "PASS",
    }
    assert _verdicts(targets, 2.0)["goodput >= 95% of 1x"] == "PASS"
    assert _verdicts(targets, 2.0)["quiet TTFT p99 <= 1.5x idle"] == "PASS"
    at_4x = _verdicts(targets, 4.0)
    assert at_4x["goodput >= 95% of 1x"] == "FAIL"
    assert at_4x["quiet TTFT p99 <= 1.5x idle"] == "FAIL"
    assert at_4x["engine queue <= its bound"] == "FAIL"


def test_a_refused_quiet_request_fails_its_ttft_target_however_fast_the_others() -> None:
    baseline = summarize_level([_served(QUIET, 1.0, 0.050)], (0.0, 10.0))
    outcomes = [_served(QUIET, 2.0, 0.050), Outcome(QUIET, 3.0, 3.0, status=429, refused_reason="queue_full")]
    row = {"scenario": "flood", "load": 1.0, **summarize_level(outcomes, (1.0, 11.0))}
    row.update(engine_queue_hwm=[0], engine_queue_bound=6)
    (ttft,) = [t for t in evaluate("on", [row], baseline) if t.name.startswith("quiet")]
    assert ttft.verdict == "FAIL"
    assert "1 of 2 not served" in ttft.detail


def test_refusal_targets() -> None:
    baseline = summarize_level([_served(QUIET, 1.0, 0.050)], (0.0, 10.0))
    slow = [_refused(2.0, 429, "queue_full", 0.080, "1")]
    unlabelled = [_refused(2.0, 503, None, 0.010, None)]
    for outcomes, p99_verdict, retry_verdict in ((slow, "FAIL", "PASS"), (unlabelled, "PASS", "FAIL")):
        row = {"scenario": "flood", "load": 8.0, **summarize_level(outcomes, (1.0, 11.0))}
        row.update(engine_queue_hwm=[0], engine_queue_bound=6)
        verdicts = _verdicts(evaluate("on", [row], baseline), 8.0)
        assert verdicts["refusal answer p99 <= 50 ms"] == p99_verdict
        assert verdicts["Retry-After on every refusal"] == retry_verdict


def test_on_beside_off() -> None:
    on = [_row("flood", 4.0, 300.0, 60.0)]
    off = [_row("flood", 4.0, 200.0, 600.0), _row("flood", 8.0, 100.0, 900.0)]
    (pair,) = compare(on, off)
    assert pair["quiet_ttft_p99_ms"] == {"on": 60.0, "off": 600.0, "on_over_off": 0.1}
    assert pair["goodput_tokens_per_s"] == {"on": 300.0, "off": 200.0, "on_over_off": 1.5}


def test_the_markdown_has_a_line_per_row_and_per_target() -> None:
    baseline = summarize_level([_served(QUIET, 1.0, 0.050)], (0.0, 10.0))
    rows = [_row("flood", 1.0, 300.0, 60.0), _row("flood", 2.0, 290.0, 70.0)]
    for row in rows:
        row["cpu_cores"] = {
            "frontend-on": 0.2,
            "client": 0.1,
            "benchmark": 0.3,
            "machine": 0.5,
            "other": 0.05,
        }
    targets = evaluate("on", rows, baseline)
    doc = {
        "profile": {"name": "quick"},
        "date": "2026-12-05T00:00:00+00:00",
        "git": {"commit": "0123456789abcdef"},
        "fleet": {**FleetShape().__dict__, "capacity_rps": 6.8},
        "calibrated_rps": {"on": 6.7},
        "configs": {"on": {"baseline": baseline, "rows": rows}},
        "targets": [t.__dict__ for t in targets],
        "comparison": [],
        "notes": ["a note"],
    }
    text = markdown(doc)
    assert "| flood | 2x | 70.0 / 70.0 (2) |  |  | 290.0 |" in text
    assert "frontend-on 0.20, benchmark 0.30, machine 0.50, other 0.05" in text
    assert text.count("| PASS |") == sum(t.verdict == "PASS" for t in targets)
    assert "- a note" in text


@given(st.integers(0, 2**32), st.floats(5.0, 60.0))
def test_a_short_priority_level_always_has_its_high_priority_requests(seed: int, rate: float) -> None:
    arrivals = schedule(rate, 1.0, 10.0, "priority", 0.05, random.Random(seed))
    flood = sum(a.kind in (HIGH, FLOOD) for a in arrivals)
    assert sum(a.kind == HIGH for a in arrivals) >= flood // 20


# -- the client, against a scripted server -------------------------------------------------


def _scripted_app(hang: asyncio.Event) -> web.Application:
    """Answers by what the request is: the quiet tenant streams 3 tokens and its finish, a
    high-priority request (it carries vLLM's priority) waits for ``hang`` before any answer,
    the flood is refused (429 with Retry-After and a reason) unless its prompt asks for a
    stream that breaks off (an error event, no finish)."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "priority" in body:
            await hang.wait()
        if request.headers[TENANT_HEADER] == "flood" and body["token_ids"][0] % 2:
            return web.Response(
                status=429, headers={"Retry-After": "2", "x-sidecar-refused-reason": "queue_full"}
            )
        response = web.StreamResponse()
        await response.prepare(request)
        quiet = request.headers[TENANT_HEADER] == "quiet"
        for i in range(3):
            finish = "length" if quiet and i == 2 else None
            event = {"choices": [{"index": 0, "token_ids": [7], "finish_reason": finish}]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if not quiet:
            await response.write(b'data: {"error": {"message": "engine died"}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    return app


async def test_the_client_records_streams_refusals_breaks_and_requests_left_waiting() -> None:
    hang = asyncio.Event()
    runner = web.AppRunner(_scripted_app(hang))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        shape = RequestShape(prompt_tokens=4, output_tokens=3, send_priority=True)
        async with Client(url, shape, seed=5) as client:
            arrivals = [Arrival(0.0, QUIET), Arrival(0.0, HIGH)] + [
                Arrival(0.01 * i, FLOOD) for i in range(12)
            ]
            outcomes = await client.open_loop(arrivals, time.perf_counter(), (0.0, 60.0), 0.2, 30.0)
    finally:
        hang.set()
        await runner.cleanup()
    quiet, high, *flood = outcomes
    assert (quiet.status, quiet.tokens, quiet.completed, quiet.ttft_s is not None) == (200, 3, True, True)
    assert quiet.tokens_in_window == 3
    # Still without an answer after the grace: it left, which is neither lost nor refused.
    assert (high.status, high.cut, high.lost) == (None, True, False)
    refused = [o for o in flood if o.refused]
    broken = [o for o in flood if o.admitted]
    assert refused
    assert broken
    assert all((o.status, o.retry_after, o.refused_reason) == (429, "2", "queue_full") for o in refused)
    assert all(o.lost and o.error_event and not o.finished for o in broken)
    row = summarize_level(outcomes, (0.0, 60.0))
    assert (row["left_waiting"], row["lost"], row["refusals"]) == (
        1,
        len(broken),
        {"429 queue_full": len(refused)},
    )


def test_a_second_run_of_the_same_commit_does_not_overwrite_the_first(tmp_path: Path) -> None:
    assert _free_name(tmp_path, "overload_2026-12-05_abc1234") == "overload_2026-12-05_abc1234"
    for stem in ("overload_2026-12-05_abc1234", "overload_2026-12-05_abc1234_run2"):
        (tmp_path / f"{stem}.json").write_text("{}")
        (tmp_path / f"{stem}.md").write_text("")
    assert _free_name(tmp_path, "overload_2026-12-05_abc1234") == "overload_2026-12-05_abc1234_run3"
    # Another commit's files are not this one's runs.
    assert _free_name(tmp_path, "overload_2026-12-05_def5678") == "overload_2026-12-05_def5678"
