"""The frontend's metrics as an operator scrapes them: no `_created` series, a build info,
buckets that stop at the request timeout, requests by reason, a departed worker's series gone,
and the fleet's gauges read from the worker set at each scrape."""

from __future__ import annotations

from prometheus_client import generate_latest

from sidecar_frontend.metrics import Metrics, WorkerRow, buckets_up_to


def test_buckets_stop_at_the_request_timeout_and_include_it() -> None:
    assert buckets_up_to(45.0)[-3:] == (10.0, 30.0, 45.0)
    assert buckets_up_to(3600.0)[-1] == 3600.0
    assert buckets_up_to(None)[-1] == 3600.0
    assert all(b < 45.0 for b in buckets_up_to(45.0)[:-1])


def test_the_scrape_has_a_build_info_no_created_series_and_duration_buckets_up_to_the_timeout() -> None:
    metrics = Metrics(version="1.2.3", request_timeout=90.0)
    metrics.request("vllm", "ok", "NONE", prompt_tokens=3, completion_tokens=4, ttft=0.01, duration=0.5)
    text = generate_latest(metrics.registry).decode()
    assert 'frontend_build_info{version="1.2.3"} 1.0' in text
    assert "_created" not in text
    assert 'frontend_request_duration_seconds_bucket{format="vllm",le="90.0"} 1.0' in text
    assert 'le="120.0"' not in text
    assert 'frontend_requests_total{format="vllm",outcome="ok",reason="NONE"} 1.0' in text


def test_a_worker_that_left_leaves_no_series_behind() -> None:
    metrics = Metrics()
    for worker in ("10.0.0.1:50051", "10.0.0.2:50051"):
        metrics.set_worker_inflight(worker, 1)
        metrics.worker_call(worker, 0.2)
        metrics.worker_first_output(worker, 0.01)
        metrics.worker_failed(worker, "CANNOT_CONNECT")
        metrics.worker_failed(worker, "OVERLOADED")
    metrics.forget_worker("10.0.0.1:50051")
    text = generate_latest(metrics.registry).decode()
    assert "10.0.0.1" not in text
    assert text.count('worker="10.0.0.2:50051"') > 5


def test_the_fleet_gauges_are_read_from_the_worker_set_at_each_scrape() -> None:
    rows = [
        WorkerRow("10.0.0.1:1", "agg", "serving", "a", ""),
        WorkerRow("10.0.0.2:1", "agg", "serving", "b", ""),
        WorkerRow("10.0.0.3:1", "agg", "refused", "b", "role"),
    ]
    metrics = Metrics()
    metrics.watch_fleet(lambda: rows)
    get = metrics.registry.get_sample_value
    assert get("frontend_workers", {"role": "agg", "state": "serving"}) == 2
    assert get("frontend_worker_refused", {"worker": "10.0.0.3:1", "reason": "role"}) == 1
    assert get("frontend_model_workers", {"model": "a", "role": "agg"}) == 1
    rows[:] = rows[1:2]  # a left, the refused worker left
    assert get("frontend_model_workers", {"model": "a", "role": "agg"}) is None
    assert get("frontend_worker_refused", {"worker": "10.0.0.3:1", "reason": "role"}) is None
    assert get("frontend_workers", {"role": "agg", "state": "serving"}) == 1
