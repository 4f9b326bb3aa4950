"""The overload benchmark still runs end to end (``python -m bench.overload --quick``: real
engines, sidecars and frontends) and writes the result file bench/README.md describes. Its
figures are not asserted: they are the benchmark's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow(90)]

ROOT = Path(__file__).resolve().parents[2]
VERDICTS = {"PASS", "FAIL", "n/a"}
ROW_FIELDS = {
    "scenario",
    "load",
    "flood_rps",
    "by_kind",
    "goodput_tokens_per_s",
    "refusals",
    "refusal_answer_p99_ms",
    "prompt_refusal_answer_p99_ms",
    "refusals_without_retry_after",
    "failures",
    "lost",
    "left_waiting",
    "cut_streams",
    "engine_queue_hwm",
    "engine_queue_bound",
    "cpu_cores",
    "dispatch_lag_p99_ms",
}


def test_quick_run_writes_the_json_and_the_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.overload", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = tmp_path.glob("overload_*_quick.json")
    assert result.with_suffix(".md").exists()
    doc = json.loads(result.read_text())

    configs = doc["configs"]
    assert set(configs) == ({"on", "off"} if doc["admission_available"] else {"off"})
    assert doc["fleet"]["capacity_rps"] > 0
    for config, run in configs.items():
        assert run["calibration"]["measured_rps"] > 0, config
        assert run["baseline"]["by_kind"]["quiet"]["ttft_samples"] > 0, config
        rows = run["rows"]
        assert [(r["scenario"], r["load"]) for r in rows] == [
            (scenario, load) for scenario in ("flood", "priority") for load in (1.0, 4.0)
        ]
        for row in rows:
            assert set(row) >= ROW_FIELDS, ROW_FIELDS - set(row)
            assert row["completed"] > 0
            assert "quiet" in row["by_kind"]
            assert len(row["engine_queue_hwm"]) == doc["fleet"]["workers"]
            pids = {"frontend-" + config, "client", "benchmark", "machine", "other"}
            pids |= {f"{role}{i}" for role in ("engine", "sidecar") for i in range(3)}
            assert set(row["cpu_cores"]) == pids
        assert any("high" in row["by_kind"] for row in rows if row["scenario"] == "priority")
    targets = doc["targets"]
    assert targets
    assert {t["verdict"] for t in targets} <= VERDICTS
    assert {t["config"] for t in targets} == set(configs)
    table = result.with_suffix(".md").read_text()
    for config in configs:
        assert f"## Admission {config}" in table
    if len(configs) == 2:
        assert len(doc["comparison"]) == 4
