"""``python -m bench.rollout`` still runs end to end in its smallest mode (stand-in engines,
sidecars, the frontend as one process and as two, and the load generator, all real processes)
and writes the result files bench/README.md describes; at small concurrency every request is
answered whole. The figures are the benchmark's, not asserted here. SMG's side needs the
package index, so it is left to the benchmark's own runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(40)]

ROOT = Path(__file__).resolve().parents[2]


def test_both_of_our_sides_answer_every_request_whole(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.rollout", "--quick", "--concurrency", "16", "--max-tokens", "32",
         "--only", "ours-1", "--only", "ours-2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "rollout_quick.md").exists()
    doc: dict[str, Any] = json.loads((tmp_path / "rollout_quick.json").read_text())
    assert doc["sides"] == ["ours-1", "ours-2"]
    assert doc["request"]["session_header"] == "X-SMG-Routing-Key"
    for side in ("ours-1", "ours-2"):
        (run,) = [r for r in doc["runs"] if r["side"] == side]
        row = run["row"]
        assert row["errors"] == 0, (side, run["result"]["error_samples"])
        assert row["requests_per_s"] > 0, side
        assert row["frontend_cpu_us_per_token"] > 0, side
        assert {"frontend", "sidecar-0", "sidecar-1"} <= set(row["proxy_cpu_us_per_token_by_process"]), side
    assert [t["verdict"] for t in doc["targets"]] == ["PASS", "PASS"]
