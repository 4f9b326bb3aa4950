"""The KV-routing benchmark still runs end to end (real processes, tiny sizes): its output has
the shape bench/README.md describes. Figures are not asserted; they are the benchmark's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kv_routing.__main__ import main


@pytest.mark.timeout(240)
def test_smoke_run_writes_the_json_and_the_table(tmp_path: Path) -> None:
    code = main(
        ["--smoke", "--workloads", "shared", "--policies", "load", "--no-micro", "--out", str(tmp_path)]
    )
    assert code == 0
    report = json.loads((tmp_path / "kv_routing.json").read_text())
    (run,) = report["fleet_runs"]
    assert (run["workload"], run["policy"], run["replicas"]) == ("shared", "load", 1)
    assert run["errors"] == 0, run["error_samples"]
    assert run["requests"] == 12
    assert sum(run["requests_per_worker"]) == 12
    assert 0.0 <= run["hit_rate"] <= 1.0
    assert 0.0 < run["best_hit_rate"] <= 1.0
    assert run["ttft_p90_ms"] >= run["ttft_p50_ms"] > 0
    assert "| shared | load | 1 |" in (tmp_path / "kv_routing.md").read_text()
