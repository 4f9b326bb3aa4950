"""bench.full_path's reading of answers and its figures: a stream's tokens and errors are
counted the same way on both sides, whatever pieces the bytes arrive in; a run's figures, the
pairs' ratios and the issue's targets follow from the results."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.full_path_stats import Scenario, markdown, pair_ratios, run_row, summarize, targets
from bench.full_path_wire import (
    ErrorKind,
    Event,
    SseLines,
    http_error,
    parse_event,
    parse_unary,
    request_body,
    stream_outcome,
)

OURS_TOKEN = (
    b'{"output_ids":[8915],"meta_info":{"id":"9f2b","finish_reason":null,"prompt_tokens":3,'
    b'"completion_tokens":1,"cached_tokens":0}}'
)
OURS_LAST = (
    b'{"output_ids":[],"meta_info":{"id":"9f2b","finish_reason":{"type":"length","length":4},'
    b'"prompt_tokens":3,"completion_tokens":4}}'
)
SMG_TOKEN = (
    b'{"text":"t8915t17179","output_ids":[17179],"meta_info":{"id":"gnt-1","finish_reason":null,'
    b'"prompt_tokens":3,"weight_version":"default","completion_tokens":2},"index":0}'
)
SMG_LAST = (
    b'{"text":"t8915t17179t2223t10263","output_ids":[10263],"meta_info":{"id":"gnt-1",'
    b'"finish_reason":"length","prompt_tokens":3,"completion_tokens":4},"index":0}'
)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (OURS_TOKEN, Event(completion_tokens=1)),
        (OURS_LAST, Event(completion_tokens=4, finished=True)),
        (SMG_TOKEN, Event(completion_tokens=2)),
        # SMG's last event repeats the last id: the count, not the ids, says how many tokens.
        (SMG_LAST, Event(completion_tokens=4, finished=True)),
        (b"[DONE]", Event(done=True)),
        (b'{"output_ids":[5,6],"meta_info":{"finish_reason":null}}', Event(completion_tokens=2)),
    ],
)
def test_events_of_both_sides_read_as_counts(payload: bytes, expected: Event) -> None:
    assert parse_event(payload) == expected


@pytest.mark.parametrize(
    "payload",
    [
        b'{"error":{"message":"engine shut down","type":"internal_error","code":500}}',
        # An error event that also carries a count is still an error.
        b'{"error":{"message":"x"},"meta_info":{"completion_tokens":3}}',
        b"not json",
        b"[1,2]",
    ],
)
def test_error_and_unreadable_events_are_errors(payload: bytes) -> None:
    assert parse_event(payload).error


OURS_ABORT = (
    b'{"output_ids":[],"meta_info":{"id":"9f2b","finish_reason":{"type":"abort","message":"CANCELLED",'
    b'"status_code":500,"err_type":"InternalServerError"},"prompt_tokens":3,"completion_tokens":0}}'
)


@pytest.mark.parametrize(
    "payload", [OURS_ABORT, b'{"meta_info":{"finish_reason":"abort","completion_tokens":2}}']
)
def test_an_abort_finish_is_an_abort_not_a_short_answer(payload: bytes) -> None:
    event = parse_event(payload)
    assert event.finished
    assert event.aborted is not None
    assert "abort" in event.aborted


def test_an_error_event_line_is_reported_as_an_error() -> None:
    (payload,) = SseLines().feed(b"event: error\n")
    assert parse_event(payload).error


STREAM = (
    b"".join(b"data: " + p + b"\n\n" for p in (SMG_TOKEN, b"[DONE]")) + b": keep-alive\n\ndata: " + OURS_LAST
)


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_payloads_do_not_depend_on_how_the_bytes_are_cut(cuts: list[int]) -> None:
    lines = SseLines()
    got: list[bytes] = []
    edges = [0, *sorted(cuts), len(STREAM)]
    for begin, end in itertools.pairwise(edges):
        got += lines.feed(STREAM[begin:end])
    got += lines.feed(b"\n")
    assert got == [SMG_TOKEN, b"[DONE]", OURS_LAST]


@pytest.mark.parametrize(
    ("finished", "tokens", "done", "expected"),
    [
        (True, 128, True, None),
        (True, 200, True, None),
        (True, 127, True, ErrorKind.SHORT),
        (False, 128, True, ErrorKind.INCOMPLETE),
        (True, 128, False, ErrorKind.INCOMPLETE),
        (False, 0, False, ErrorKind.INCOMPLETE),
    ],
)
def test_a_stream_is_whole_only_finished_ended_and_full(
    finished: bool, tokens: int, done: bool, expected: ErrorKind | None
) -> None:
    assert stream_outcome(finished, tokens, 128, done) == expected


@pytest.mark.parametrize(
    ("body", "tokens", "error"),
    [
        (b'{"output_ids":[1,2,3,4],"meta_info":{"finish_reason":{"type":"length","length":4}}}', 4, None),
        (b'[{"text":"a","output_ids":[1,2,3,4],"meta_info":{"finish_reason":{"type":"length"}}}]', 4, None),
        (b'{"output_ids":[1,2],"meta_info":{"finish_reason":{"type":"length"}}}', 2, ErrorKind.SHORT),
        (
            b'{"output_ids":[],"meta_info":{"finish_reason":{"type":"abort","status_code":500}}}',
            0,
            ErrorKind.ABORT_FINISH,
        ),
        (b'{"output_ids":[1,2,3,4],"meta_info":{"finish_reason":null}}', 4, ErrorKind.INCOMPLETE),
        (b'{"error":{"message":"no"}}', 0, ErrorKind.BAD_BODY),
        (b'{"text":"a"}', 0, ErrorKind.BAD_BODY),
        (b"<html>", 0, ErrorKind.BAD_BODY),
    ],
)
def test_unary_answers(body: bytes, tokens: int, error: ErrorKind | None) -> None:
    answer = parse_unary(body, 4)
    assert (answer.tokens, answer.error) == (tokens, error)


def test_both_sides_get_the_same_request() -> None:
    body = json.loads(request_body("m", 3, 7, 128, True, 16))
    assert body["model"] == "m"
    assert body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 128, "ignore_eos": True}
    assert len(body["input_ids"]) == 16
    assert json.loads(request_body("m", 3, 8, 128, False, 16))["input_ids"] != body["input_ids"]
    assert http_error(503) == "http_503"


def _result(tokens: int, proxy_cpu: dict[str, float], errors: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "window_s": 10.0,
        "tokens": tokens,
        "tokens_per_s": tokens / 10.0,
        "requests_per_s": tokens / 1280.0,
        "cpu_s": {**proxy_cpu, "engine": 1.0, "client": 2.0, "other": 0.5, "steal": 0.0},
        "ttft_ms": {"p50": 400.0, "p99": 800.0},
        "latency_ms": {"p50": 900.0, "p99": 1500.0},
        "errors": errors or {},
        "clients_with_errors": 1 if errors else 0,
    }


def _run(pair: int, scenario: str, side: str, result: dict[str, Any]) -> dict[str, Any]:
    proxies = ["frontend", "sidecar"] if side == "ours" else ["smg"]
    return {"pair": pair, "scenario": scenario, "side": side, "row": run_row(result, proxies)}


def test_a_runs_cpu_per_token_is_its_proxies_only() -> None:
    row = run_row(_result(100_000, {"frontend": 5.0, "sidecar": 7.0}), ["frontend", "sidecar"])
    assert row["proxy_cpu_us_per_token"] == 120.0
    assert row["proxy_cpu_us_per_token_by_process"] == {"frontend": 50.0, "sidecar": 70.0}
    assert row["proxy_cores"] == 1.2
    assert row["load_side_cores"] == 0.3


LOW = Scenario("stream-256", True, 256, 3.0, 10.0)
HIGH = Scenario("stream-2048", True, 2048, 10.0, 40.0)
UNARY = Scenario("unary-2048", False, 2048, 15.0, 40.0)


def _two_pairs(ours_cpu: tuple[float, float], ours_errors: dict[str, int]) -> list[dict[str, Any]]:
    runs = []
    for pair, cpu in enumerate(ours_cpu):
        for scenario in (LOW, HIGH, UNARY):
            runs.append(
                _run(
                    pair,
                    scenario.name,
                    "ours",
                    _result(80_000, {"frontend": cpu, "sidecar": cpu}, ours_errors),
                )
            )
            runs.append(_run(pair, scenario.name, "smg", _result(300_000, {"smg": 7.0})))
    return runs


def test_ratios_are_taken_within_pairs() -> None:
    runs = _two_pairs((4.0, 5.0), {})
    # 8 s / 80k tokens = 100 µs, 10 s / 80k = 125 µs; SMG 7 s / 300k = 23.33 µs.
    assert pair_ratios(runs, LOW.name, "proxy_cpu_us_per_token") == [4.286, 5.358]
    assert pair_ratios(runs, HIGH.name, "tokens_per_s") == [0.267, 0.267]
    assert pair_ratios([r for r in runs if r["side"] == "ours"], LOW.name, "tokens_per_s") == []


def test_the_issues_picture_misses_every_target() -> None:
    runs = _two_pairs((4.0, 5.0), {"sse_error_event": 700, "http_500": 2})
    summary = summarize(runs, [LOW, HIGH, UNARY])
    assert summary[HIGH.name]["sides"]["ours"]["errors_by_kind"] == {"sse_error_event": 1400, "http_500": 4}
    assert summary[LOW.name]["ratios"]["proxy_cpu_us_per_token"]["median"] == pytest.approx(4.822)
    verdicts = [t.verdict for t in targets(summary, [LOW, HIGH, UNARY])]
    assert verdicts == ["MISS"] * 5


def test_a_path_as_good_as_smg_passes_every_target() -> None:
    runs = []
    for scenario in (LOW, HIGH, UNARY):
        runs.append(_run(0, scenario.name, "ours", _result(300_000, {"frontend": 3.0, "sidecar": 6.0})))
        runs.append(_run(0, scenario.name, "smg", _result(300_000, {"smg": 7.0})))
    found = targets(summarize(runs, [LOW, HIGH, UNARY]), [LOW, HIGH, UNARY])
    assert [t.verdict for t in found] == ["PASS"] * 5
    assert found[0].value == "1.29x"


def test_without_smg_the_ratios_are_not_judged_but_errors_are() -> None:
    runs = [r for r in _two_pairs((4.0, 4.0), {}) if r["side"] == "ours"]
    found = targets(summarize(runs, [LOW, HIGH, UNARY]), [LOW, HIGH, UNARY])
    assert [t.verdict for t in found] == ["n/a", "PASS", "n/a", "PASS", "n/a"]


def test_the_table_shows_each_side_the_ratios_and_the_verdicts() -> None:
    runs = _two_pairs((4.0, 5.0), {"sse_error_event": 3})
    scenarios = [LOW, HIGH, UNARY]
    summary = summarize(runs, scenarios)
    doc = {
        "date": "2026-12-05",
        "profile": "full",
        "pairs": 2,
        "scenarios": [s.__dict__ for s in scenarios],
        "ours": {"code": "/work/main", "processes": None},
        "smg": {"version": "smg 1.13.0"},
        "pinning": "engine + load generator on CPU 0, proxies on CPU 1",
        "request": {"prompt_tokens": 16, "max_tokens": 128},
        "summary": summary,
        "targets": [t.__dict__ for t in targets(summary, scenarios)],
        "notes": ["a note"],
    }
    text = markdown(doc)
    assert "| frontend + sidecar | 8,000 |" in text
    assert "| SMG | 30,000 |" in text
    assert "**6** (sse_error_event 6)" in text
    assert "Ours / SMG's: tokens/s 0.27x" in text
    assert text.count("- **MISS**") == 5
    assert "- a note" in text
    assert "Ours: not run" in markdown({**doc, "ours": {}})
    assert "SMG: not run" in markdown({**doc, "smg": {}})
