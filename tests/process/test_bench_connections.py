"""``python -m bench.connections --quick``: 500 connections, each first idle then carrying a
stream, through one real frontend over a testkit engine and its sidecar. Every stream ends
with all its tokens (no error), and the frontend, started with a soft open files limit of
1,024, raised it to the hard limit and said so. The memory figures are the benchmark's."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(15)]

ROOT = Path(__file__).resolve().parents[2]


def test_500_connections_and_streams_without_an_error_and_the_open_files_limit_raised(
    tmp_path: Path,
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the open files hard limit ({hard}) leaves nothing to raise to")
    done = subprocess.run(
        [sys.executable, "-m", "bench.connections", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "connections_500.json").read_text())
    assert report["errors"] == 0, report["error_samples"]
    assert report["streams_finished"] == 500
    assert report["idle_connections_kept"] == 500
    files = report["frontend_open_files"]
    assert files["started_with"] == 1024
    expected = hard if hard != resource.RLIM_INFINITY else files["soft_now"]
    assert files["soft_now"] == expected > 1024
    assert files["logged"]["open_files"] == files["soft_now"]
    assert files["logged"]["open_files_raised_from"] == 1024
    assert report["listen_backlog"] >= 128
    assert (tmp_path / "connections_500.md").read_text().startswith("# 500 connections")
