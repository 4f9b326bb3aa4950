"""``bench.grpc_floor``'s figures: CPU per message and per call of each side from one run's raw
counts, medians over rounds by scenario and variant, and the table the result file holds."""

from __future__ import annotations

from typing import Any

import pytest

from bench.grpc_floor import per_message, summarize, table


def _raw(messages: int, calls: int, seconds: float, reader: float, writer: float) -> dict[str, Any]:
    return {
        "messages": messages,
        "calls": calls,
        "seconds": seconds,
        "reader_cpu_s": reader,
        "writer_cpu_s": writer,
    }


def test_per_message_divides_each_sides_cpu_by_the_messages_and_the_calls_it_moved() -> None:
    f = per_message(_raw(messages=40_000, calls=312, seconds=2.0, reader=1.0, writer=0.5))
    assert f["messages_per_s"] == pytest.approx(20_000)
    assert f["calls_per_s"] == pytest.approx(156)
    assert f["reader_us_per_message"] == pytest.approx(25.0)
    assert f["writer_us_per_message"] == pytest.approx(12.5)
    assert f["reader_us_per_call"] == pytest.approx(1.0 / 312 * 1e6)
    assert f["writer_us_per_call"] == pytest.approx(0.5 / 312 * 1e6)
    assert f["reader_cores"] == pytest.approx(0.5)
    assert f["writer_cores"] == pytest.approx(0.25)


@pytest.mark.parametrize("field", ["messages", "calls", "seconds"])
def test_a_run_that_moved_nothing_is_refused_rather_than_divided(field: str) -> None:
    raw = _raw(messages=10, calls=1, seconds=1.0, reader=0.1, writer=0.1)
    raw[field] = 0
    with pytest.raises(ValueError, match="moved nothing"):
        per_message(raw)


def test_summarize_takes_the_median_of_each_figure_by_scenario_and_variant() -> None:
    def run(scenario: str, variant: str, reader: float) -> dict[str, Any]:
        return {
            "scenario": scenario,
            "variant": variant,
            "figures": per_message(_raw(1_000, 10, 1.0, reader, 0.01)),
        }

    runs = [run("s", "default", r) for r in (0.030, 0.010, 0.020)] + [
        run("s", "other", 0.040),
        run("u", "default", 0.5),
    ]
    summary = summarize(runs)
    assert set(summary) == {"s", "u"}
    assert set(summary["s"]) == {"default", "other"}
    assert summary["s"]["default"]["reader_us_per_message"] == pytest.approx(20.0)
    assert summary["s"]["other"]["reader_us_per_message"] == pytest.approx(40.0)
    assert summary["u"]["default"]["reader_us_per_call"] == pytest.approx(50_000.0)


def test_the_table_has_one_row_per_scenario_and_variant_with_its_figures() -> None:
    summary = summarize(
        [
            {
                "scenario": "stream-8x16",
                "variant": "default",
                "figures": per_message(_raw(2_000, 125, 1.0, 0.05, 0.04)),
            }
        ]
    )
    text = table(summary, rounds=1)
    (row,) = [line for line in text.splitlines() if line.startswith("| stream-8x16 ")]
    assert row == "| stream-8x16 | default | 2,000 | 25.0 | 20.0 | 400.0 | 320.0 | 0.05 | 0.04 |"
