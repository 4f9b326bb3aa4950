"""``python -m bench.full_path`` still runs end to end in its smallest mode (real engine,
sidecar, frontend and load generator processes) and writes the result file bench/README.md
describes; at small concurrency our path answers every request whole. Throughput and CPU are
the benchmark's figures, not asserted here.

SMG's side needs the package index (its venv is installed from PyPI when missing), so that test
carries the ``install`` marker: ``make deploy-check``'s kind of run, not ``make test``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(40)]

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = ["--quick", "--streams", "4,16", "--unary", "8", "--max-tokens", "32", "--quiet-wait", "0"]
ROW_FIELDS = {
    "tokens_per_s",
    "requests_per_s",
    "proxy_cpu_us_per_token",
    "proxy_cpu_us_per_token_by_process",
    "proxy_cores",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "latency_p99_ms",
    "errors",
    "errors_by_kind",
}


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.full_path", *SMALLEST, *extra, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "full_path_quick.md").exists()
    doc: dict[str, Any] = json.loads((tmp_path / "full_path_quick.json").read_text())
    return doc


def _check_side(doc: dict[str, Any], side: str, proxies: set[str]) -> None:
    scenarios = {s["name"]: s for s in doc["scenarios"]}
    assert set(scenarios) == {"stream-4", "stream-16", "unary-8"}
    for name, scenario in scenarios.items():
        (run,) = [r for r in doc["runs"] if r["scenario"] == name and r["side"] == side]
        row = run["row"]
        assert set(row) >= ROW_FIELDS, name
        assert row["errors"] == 0, (name, run["result"]["error_samples"])
        assert row["tokens_per_s"] > 0, name
        assert row["requests_per_s"] > 0, name
        assert set(row["proxy_cpu_us_per_token_by_process"]) == proxies, name
        assert row["proxy_cpu_us_per_token"] > 0, name
        assert (row["ttft_p99_ms"] is not None) == scenario["stream"], name
        assert doc["summary"][name]["sides"][side]["errors_total"] == 0


def test_our_path_in_the_smallest_mode_answers_every_request_whole(tmp_path: Path) -> None:
    doc = _run(tmp_path, "--only", "ours")
    assert doc["sides"] == ["ours"]
    assert doc["request"]["example"]["input_ids"]
    assert doc["ours"]["imported_from"] == str(ROOT)
    _check_side(doc, "ours", {"frontend", "sidecar"})
    verdicts = {t["name"]: t["verdict"] for t in doc["targets"]}
    assert [v for n, v in verdicts.items() if "zero errors" in n] == ["PASS", "PASS"]
    assert {v for n, v in verdicts.items() if "SMG's" in n} == {"n/a"}


@pytest.mark.install
def test_smg_in_front_of_the_same_engine_answers_every_request_whole(tmp_path: Path) -> None:
    doc = _run(tmp_path, "--only", "smg")
    assert doc["smg"]["version"].startswith("smg ")
    _check_side(doc, "smg", {"smg"})
