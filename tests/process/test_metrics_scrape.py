"""What an operator scrapes and reads: ``/metrics`` of a real ``sidecar-vllm`` in front of a
real ``testkit-engine vllm``, its per-request log lines, and the Grafana dashboard's queries
checked against the names that scrape exports; the same for a real ``sidecar-frontend`` over
them and its dashboard."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.version import package_version
from tests.e2e_helpers import ROOT, WAIT, free_port, log_lines, process, script, serving_port

pytestmark = pytest.mark.timeout(120)

DASHBOARD = ROOT / "deploy" / "grafana" / "sidecar.json"
FRONTEND_DASHBOARD = ROOT / "deploy" / "grafana" / "frontend.json"


@dataclass(frozen=True)
class Session:
    scrape: str  # /metrics after the requests below
    logs: list[dict[str, Any]]  # the sidecar's JSON log lines, up to its exit
    prompt_tokens: int  # of the two served requests
    completion_tokens: int  # that the client received


def _value(scrape: str, sample: str) -> float:
    """The value of one sample line, ``name{labels}`` exactly as exposed."""
    for line in scrape.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {sample} in:\n{scrape}")


@pytest.fixture(scope="module")
def session() -> Session:
    engine_port, metrics_port = free_port(), free_port()
    engine_argv = [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"]
    sidecar_argv = [
        script("sidecar-vllm"),
        *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", "127.0.0.1:0"),
        *(
            "--metrics-port",
            str(metrics_port),
            "--log-format",
            "json",
            "--grpc-startup-deadline-secs",
            str(WAIT),
        ),
    ]
    with process(engine_argv), process(sidecar_argv) as sidecar:
        port = serving_port(sidecar)
        prompts = [[5, 6, 7, 8], [9, 10]]
        received = 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            for i, prompt in enumerate(prompts):
                request = sidecar_pb2.PreprocessedRequest(request_id=f"served-{i}", token_ids=prompt)
                request.stop_conditions.max_tokens = 5
                received += sum(len(out.token_ids) for out in stub.Generate(request, timeout=WAIT))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(sidecar_pb2.PreprocessedRequest(request_id="empty"), timeout=WAIT))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT) as response:
            scrape = response.read().decode()
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=WAIT) == 0
        logs = list(log_lines(sidecar))
    return Session(scrape, logs, sum(map(len, prompts)), received)


def test_metrics_count_arrivals_outcomes_tokens_and_durations(session: Session) -> None:
    m = session.scrape
    vllm = '{engine="vllm"}'
    assert _value(m, f"sidecar_requests_started_total{vllm}") == 3
    finished = sum(
        float(line.rsplit(" ", 1)[1])
        for line in m.splitlines()
        if line.startswith("sidecar_requests_finished_total{")
    )
    assert finished == 2
    assert _value(m, 'sidecar_requests_failed_total{engine="vllm",reason="INVALID_ARGUMENT"}') == 1
    assert _value(m, 'sidecar_requests_refused_total{engine="vllm",reason="INVALID_ARGUMENT"}') == 1
    assert _value(m, f"sidecar_inflight_requests{vllm}") == 0
    assert _value(m, f"sidecar_engine_connected{vllm}") == 1
    assert _value(m, f"sidecar_prompt_tokens_total{vllm}") == session.prompt_tokens
    assert _value(m, f"sidecar_completion_tokens_total{vllm}") == session.completion_tokens > 0
    assert _value(m, f"sidecar_request_duration_seconds_count{vllm}") == 2
    assert _value(m, f"sidecar_time_to_first_token_seconds_count{vllm}") == 2
    assert _value(m, f'sidecar_build_info{{engine="vllm",version="{package_version()}"}}') == 1
    assert "_created" not in m


def test_one_log_line_per_request_and_one_per_refusal(session: Session) -> None:
    finished = [e for e in session.logs if e.get("event") == "generate finished"]
    assert [e["public_id"] for e in finished] == ["served-0", "served-1"]
    for line in finished:
        assert line["level"] == "info"
        assert str(line["private_id"]).endswith(str(line["public_id"]))
        assert line["finish_reason"] in ("LENGTH", "EOS", "STOP")
        assert line["engine_aborted"] is False
        assert float(line["duration_secs"]) > 0
    assert sum(int(e["prompt_tokens"]) for e in finished) == session.prompt_tokens
    assert sum(int(e["completion_tokens"]) for e in finished) == session.completion_tokens
    refused = [e for e in session.logs if e.get("event") == "generate refused"]
    assert len(refused) == 1
    assert refused[0]["reason"] == "INVALID_ARGUMENT"
    assert refused[0]["public_id"] == "empty"


# --- the dashboard ------------------------------------------------------------------------------

# Everything in an expression that is not a metric name: PromQL functions and keywords, and the
# label names the queries group or filter by.
_PROMQL_WORDS = frozenset({"sum", "min", "max", "rate", "histogram_quantile", "by", "label_values", "topk"})
_LABELS = frozenset(
    {
        *("le", "engine", "instance", "reason", "finish_reason", "outcome", "worker", "model", "role"),
        *("state", "task", "kind", "band", "format"),
    }
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" or (key == "query" and isinstance(value, str)):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            walk(variable.get("query"))
    return found


def _names_in(expr: str) -> set[str]:
    """Identifiers of an expression, without string literals, ranges and $variables."""
    bare = _STRINGS.sub('""', expr)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\$\w+", "", bare)
    return {word for word in _IDENTIFIER.findall(bare) if not re.fullmatch(r"[0-9.]+", word)}


def _exported(scrape: str) -> set[str]:
    names: set[str] = set()
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_dashboard_query_names_only_metrics_the_sidecar_exports(session: Session) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported(session.scrape)
    expressions = _expressions(dashboard)
    used: set[str] = set()
    for expr in expressions:
        names = _names_in(expr)
        metrics = names - _PROMQL_WORDS - _LABELS
        assert metrics, f"no metric in {expr!r}"
        unknown = metrics - exported
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the sidecar does not export"
        used |= metrics
    # What the issue asks the dashboard to show: tokens/s, in-flight, TTFT and inter-chunk
    # percentiles, errors by reason, aborts.
    for wanted in (
        "sidecar_completion_tokens_total",
        "sidecar_prompt_tokens_total",
        "sidecar_inflight_requests",
        "sidecar_time_to_first_token_seconds_bucket",
        "sidecar_inter_chunk_latency_seconds_bucket",
        "sidecar_requests_failed_total",
        "sidecar_engine_aborts_total",
    ):
        assert wanted in used, f"the dashboard shows no {wanted}"


def test_the_dashboard_check_catches_a_misspelt_metric(session: Session) -> None:
    exported = _exported(session.scrape)
    expr = 'sum(rate(sidecar_completion_token_total{engine=~"$engine"}[$__rate_interval]))'
    assert _names_in(expr) - _PROMQL_WORDS - _LABELS - exported == {"sidecar_completion_token_total"}


# --- the frontend -------------------------------------------------------------------------------

REQUEST_TIMEOUT = 600


@dataclass(frozen=True)
class FrontendSession:
    scrape: str
    logs: list[dict[str, Any]]
    worker: str  # the sidecar's address, as the frontend labels it


def _post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)


def _until_healthy(url: str) -> None:
    deadline = time.monotonic() + WAIT
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the frontend never had a serving worker")
        time.sleep(0.1)  # polling a real process: there is no event to wait on


@pytest.fixture(scope="module")
def frontend_session() -> FrontendSession:
    engine_port, metrics_port = free_port(), free_port()
    engine_argv = [
        script("testkit-engine"),
        *("vllm", "--listen", f"127.0.0.1:{engine_port}"),
        *("--fault", "boom=error_after:0:invalid_argument"),
    ]
    sidecar_argv = [
        script("sidecar-vllm"),
        *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", "127.0.0.1:0", "--log-format", "json"),
    ]
    with process(engine_argv), process(sidecar_argv) as sidecar:
        worker = f"127.0.0.1:{serving_port(sidecar)}"
        frontend_argv = [
            script("sidecar-frontend"),
            *("--worker", worker, "--listen", "127.0.0.1:0", "--log-format", "json"),
            *("--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"),
            *("--request-timeout-secs", str(REQUEST_TIMEOUT)),
        ]
        with process(frontend_argv) as frontend:
            head: list[dict[str, Any]] = []
            for entry in log_lines(frontend):
                head.append(entry)
                if entry.get("event") == "serving":
                    break
            url = f"http://127.0.0.1:{head[-1]['port']}"
            _until_healthy(url)
            sampling = {"max_tokens": 3}
            statuses = [
                _post(url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}),
                _post(url + "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": sampling}),
                _post(url + "/inference/v1/generate", {"token_ids": [], "sampling_params": sampling}),
                _post(
                    url + "/inference/v1/generate",
                    {"token_ids": [5], "sampling_params": sampling, "model": "nobody"},
                ),
                _post(url + "/generate", {"input_ids": [5], "rid": "boom", "sampling_params": {}}),
            ]
            assert statuses[:4] == [200, 200, 400, 404]
            assert statuses[4] >= 400
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT) as response:
                scrape = response.read().decode()
            frontend.send_signal(signal.SIGTERM)
            assert frontend.wait(timeout=WAIT) == 0
            logs = head + list(log_lines(frontend))
    return FrontendSession(scrape, logs, worker)


def test_frontend_metrics_say_why_requests_ended_and_how_each_worker_did(
    frontend_session: FrontendSession,
) -> None:
    m, worker = frontend_session.scrape, frontend_session.worker
    requests = "frontend_requests_total"
    assert _value(m, f'{requests}{{format="sglang",outcome="ok",reason="NONE"}}') == 1
    assert _value(m, f'{requests}{{format="vllm",outcome="ok",reason="NONE"}}') == 1
    assert _value(m, f'{requests}{{format="vllm",outcome="invalid",reason="INVALID_REQUEST"}}') == 1
    assert _value(m, f'{requests}{{format="vllm",outcome="invalid",reason="MODEL_NOT_FOUND"}}') == 1
    assert _value(m, f'{requests}{{format="sglang",outcome="error",reason="INVALID_ARGUMENT"}}') == 1
    assert _value(m, f'frontend_worker_request_duration_seconds_count{{worker="{worker}"}}') == 3
    assert _value(m, f'frontend_worker_time_to_first_token_seconds_count{{worker="{worker}"}}') == 2
    assert _value(m, f'frontend_worker_failures_total{{reason="INVALID_ARGUMENT",worker="{worker}"}}') == 1
    assert _value(m, f'frontend_worker_inflight{{worker="{worker}"}}') == 0
    assert _value(m, 'frontend_workers{role="agg",state="serving"}') == 1
    assert _value(m, 'frontend_model_workers{model="testkit-model",role="agg"}') == 1
    assert _value(m, f'frontend_build_info{{version="{package_version()}"}}') == 1
    assert "_created" not in m
    # The buckets stop at the request timeout.
    last = f'frontend_request_duration_seconds_bucket{{format="sglang",le="{REQUEST_TIMEOUT:.1f}"}}'
    assert _value(m, last) == _value(m, 'frontend_request_duration_seconds_count{format="sglang"}') == 2
    assert 'le="1200.0"' not in m


def test_frontend_metrics_listen_on_metrics_host_and_refused_requests_are_logged_with_why(
    frontend_session: FrontendSession,
) -> None:
    (up,) = [e for e in frontend_session.logs if e.get("event") == "metrics endpoint up"]
    assert up["host"] == "127.0.0.1"
    refused = [e for e in frontend_session.logs if e.get("event") == "request" and e["outcome"] == "invalid"]
    assert sorted(e["reason"] for e in refused) == ["INVALID_REQUEST", "MODEL_NOT_FOUND"]
    (not_found,) = [e for e in refused if e["reason"] == "MODEL_NOT_FOUND"]
    assert not_found["status"] == 404
    assert "The model `nobody` does not exist" in not_found["error"]


def test_every_frontend_dashboard_query_names_only_metrics_the_frontend_exports(
    frontend_session: FrontendSession,
) -> None:
    dashboard = json.loads(FRONTEND_DASHBOARD.read_text())
    exported = _exported(frontend_session.scrape)
    used: set[str] = set()
    for expr in _expressions(dashboard):
        metrics = _names_in(expr) - _PROMQL_WORDS - _LABELS
        assert metrics, f"no metric in {expr!r}"
        unknown = metrics - exported
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the frontend does not export"
        used |= metrics
    # What the issues ask the frontend's dashboard to answer: which worker is slow, which fails
    # and why, why clients are refused, which workers are not used, how the KV cache routes.
    for wanted in (
        "frontend_requests_total",
        "frontend_worker_request_duration_seconds_bucket",
        "frontend_worker_time_to_first_token_seconds_bucket",
        "frontend_worker_failures_total",
        "frontend_worker_refused",
        "frontend_workers",
        "frontend_model_workers",
        "frontend_build_info",
        # KV-cache routing: the hit rate, why workers were chosen, the index, the events lag.
        "frontend_kv_reported_cached_tokens_total",
        "frontend_kv_prompt_tokens_total",
        "frontend_routing_decisions_total",
        "frontend_kv_index_blocks",
        "frontend_kv_events_lag_seconds_bucket",
        # A background task that failed, a worker whose replies were refused (issue 26).
        "frontend_background_failures_total",
        "frontend_worker_misbehaviour_total",
        # Admission and overload (issue 27): queues, waits, decisions, saturation, the retry
        # budget, outlier ejection.
        "frontend_admission_queued",
        "frontend_admission_wait_seconds_bucket",
        "frontend_admission_decisions_total",
        "frontend_worker_saturation",
        "frontend_retries_refused_total",
        "frontend_worker_ejections_total",
        "frontend_worker_restorations_total",
        "frontend_admission_preemptions_total",
    ):
        assert wanted in used, f"the frontend dashboard shows no {wanted}"
