"""The fan-out replies as SMG writes them: every worker flushed (200), some not (206 with both
lists), none registered (200, nothing to flush); loads with each worker's details."""

from __future__ import annotations

import pytest

from sidecar_frontend.fanout import FlushOutcome, LoadRow, flush_reply, loads_reply


@pytest.mark.parametrize(
    ("outcomes", "status", "body"),
    [
        (
            [],
            200,
            {
                "status": "success",
                "message": "No workers registered; nothing to flush",
                "workers_flushed": 0,
                "total_workers": 0,
            },
        ),
        (
            [FlushOutcome("grpc://a:1"), FlushOutcome("http://b:2")],
            200,
            {
                "status": "success",
                "message": "Successfully flushed cache on all 2 workers",
                "workers_flushed": 2,
                "total_workers": 2,
            },
        ),
        (
            [FlushOutcome("grpc://a:1"), FlushOutcome("http://b:2", "FAILED_PRECONDITION: busy")],
            206,
            {
                "status": "partial_success",
                "message": "Cache flush: 1 succeeded, 1 failed",
                "workers_flushed": 1,
                "total_workers": 2,
                "successful": ["grpc://a:1"],
                "failed": [{"worker": "http://b:2", "error": "FAILED_PRECONDITION: busy"}],
            },
        ),
    ],
)
def test_flush_replies(outcomes: list[FlushOutcome], status: int, body: dict[str, object]) -> None:
    assert flush_reply(outcomes) == (status, body)


def test_loads_name_each_worker_with_its_engines_figures() -> None:
    row = LoadRow("http://b:2", 3, 2, None, 0.5, "paused", "v7")
    assert loads_reply([row]) == {
        "workers": [
            {
                "worker": "http://b:2",
                "load": 3,
                "details": {
                    "running_requests": 2,
                    "waiting_requests": None,
                    "kv_usage": 0.5,
                    "engine_state": "paused",
                    "weight_version": "v7",
                },
            }
        ]
    }
