"""What an operator scrapes and reads: ``/metrics`` of a real ``sidecar-vllm`` in front of a
real ``testkit-engine vllm``, its per-request log lines, and the Grafana dashboard's queries
checked against the names that scrape exports."""

from __future__ import annotations

import json
import re
import signal
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
_PROMQL_WORDS = frozenset({"sum", "min", "max", "rate", "histogram_quantile", "by", "label_values"})
_LABELS = frozenset({"le", "engine", "instance", "reason", "finish_reason", "outcome"})
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
