"""``python -m bench.grpc_floor`` still runs end to end in its smallest mode (a writer and a
reader process per scenario and variant, grpc.aio or a bare framed TCP stream, pinned as the
benchmark pins them) and writes the result files bench/README.md describes. The figures are the
benchmark's, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(15)]

ROOT = Path(__file__).resolve().parents[2]


def test_every_scenario_and_variant_moves_messages_and_is_written_down(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.grpc_floor", "--quick", "--streams", "8", "--messages", "16",
         "--unary", "8", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "grpc_floor_quick.md").exists()
    doc: dict[str, Any] = json.loads((tmp_path / "grpc_floor_quick.json").read_text())
    assert set(doc["summary"]) == {"stream-8x16", "unary-8"}
    # The raw framed-TCP stream runs beside gRPC for streams only (it has no calls of its own).
    assert set(doc["summary"]["stream-8x16"]) == {"default", "no-ee-client", "raw-tcp"}
    assert set(doc["summary"]["unary-8"]) == {"default", "no-ee-client"}
    for variants in doc["summary"].values():
        for figures in variants.values():
            assert figures["messages_per_s"] > 0
            assert figures["reader_us_per_message"] > 0
            assert figures["writer_us_per_message"] > 0
            assert figures["calls_per_s"] > 0
