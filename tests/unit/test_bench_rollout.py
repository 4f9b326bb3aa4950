"""bench.rollout's figures: each side's spread over its runs, our sides over SMG's within a
pair, the no-error target, and the table naming every side that ran."""

from __future__ import annotations

from typing import Any

from bench.rollout import side_row
from bench.rollout_stats import markdown, ratios, summarize, targets


def _result(
    requests_per_s: float, tokens: int, cpu: dict[str, float], errors: dict[str, int]
) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "window_s": 10.0,
        "tokens_per_s": tokens / 10.0,
        "requests_per_s": requests_per_s,
        "cpu_s": {**cpu, "client": 1.0, "other": 0.0, "steal": 0.0},
        "ttft_ms": {"p50": None, "p99": None},
        "latency_ms": {"p50": 100.0, "p99": 200.0 if "frontend" in cpu else 50.0},
        "errors": errors,
    }


def _runs() -> list[dict[str, Any]]:
    runs = []
    for pair, scale in ((0, 1.0), (1, 2.0)):
        ours = _result(100.0 * scale, 1_000_000, {"frontend": 8.0, "sidecar-0": 4.0}, {})
        twin = _result(90.0 * scale, 1_000_000, {"frontend": 10.0, "sidecar-0": 4.0}, {"http_503": pair})
        theirs = _result(400.0 * scale, 1_000_000, {"smg": 2.0}, {})
        runs.append({"pair": pair, "side": "ours-1", "row": side_row(ours, ["frontend", "sidecar-0"])})
        runs.append({"pair": pair, "side": "ours-2", "row": side_row(twin, ["frontend", "sidecar-0"])})
        runs.append({"pair": pair, "side": "smg", "row": side_row(theirs, ["smg"])})
    return runs


def test_the_frontend_figure_is_its_own_cpu_and_the_proxy_figure_every_process() -> None:
    row = side_row(
        _result(1.0, 1_000_000, {"frontend": 8.0, "sidecar-0": 4.0}, {}), ["frontend", "sidecar-0"]
    )
    assert row["frontend_cpu_us_per_token"] == 8.0
    assert row["proxy_cpu_us_per_token"] == 12.0
    assert side_row(_result(1.0, 1_000_000, {"smg": 2.0}, {}), ["smg"])["frontend_cpu_us_per_token"] is None


def test_ratios_are_within_a_pair_and_summaries_span_the_runs() -> None:
    runs = _runs()
    assert ratios(runs, "ours-1", "requests_per_s") == {"median": 0.25, "min": 0.25, "max": 0.25}
    assert ratios(runs, "ours-1", "proxy_cpu_us_per_token") == {"median": 6.0, "min": 6.0, "max": 6.0}
    summary = summarize(runs)
    assert summary["ours-1"]["requests_per_s"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    assert summary["ours-2"]["errors_by_kind"] == {"http_503": 1}
    assert ratios(runs, "ours-1", "no_such_metric") is None


def test_a_side_with_an_error_misses_the_target_and_the_table_says_so() -> None:
    runs = _runs()
    summary = summarize(runs)
    verdicts = {t.name.split(",")[0]: t.verdict for t in targets(summary, 2000)}
    assert verdicts == {
        "frontend (1 process) + sidecars": "PASS",
        "frontend (`--processes 2`) + sidecars": "MISS",
    }
    doc = {
        "date": "2026-12-05",
        "profile": "full",
        "pairs": 2,
        "concurrency": 2000,
        "engines": 2,
        "request": {"prompt_tokens": 16, "max_tokens": 128, "session_header": "X-SMG-Routing-Key"},
        "pinning": "pinned",
        "smg": {"version": "smg 1.13.0"},
        "summary": summary,
        "ratios": {s: {m: ratios(runs, s, m) for m in ("requests_per_s",)} for s in ("ours-1", "ours-2")},
        "targets": [t.__dict__ for t in targets(summary, 2000)],
    }
    table = markdown(doc)
    assert "| SMG | 600.0 (400.0-800.0) |" in table
    assert "**1** (http_503 1)" in table
    assert "| MISS |" in table
