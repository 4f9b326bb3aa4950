"""Spans leave over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set: real ``sidecar-frontend``,
``sidecar-vllm`` and ``testkit-engine`` processes, and an OTLP/gRPC collector in the test
that keeps what it is sent."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.e2e_helpers import WAIT, free_port, log_lines, script, serving_port, start, stop
from tests.process.test_frontend_process import PROMPT, wait_ready

pytestmark = pytest.mark.timeout(120)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attributes.get("service.name", ""), s) for s in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


def test_frontend_and_sidecar_export_one_trace_over_otlp(collector: tuple[Collector, int]) -> None:
    spans, otlp_port = collector
    otlp = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    with ExitStack() as stack:
        engine_port = free_port()
        engine = start([script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"], {})
        stack.callback(stop, engine)
        sidecar = start(
            [
                script("sidecar-vllm"),
                *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", "127.0.0.1:0"),
                *("--grpc-connections", "1", "--log-format", "json"),
            ],
            otlp,
        )
        stack.callback(stop, sidecar)
        worker = serving_port(sidecar)
        frontend = start(
            [
                script("sidecar-frontend"),
                *("--listen", "127.0.0.1:0", "--log-format", "json", "--worker", f"127.0.0.1:{worker}"),
            ],
            {**otlp, "OTEL_SERVICE_NAME": "my-frontend"},
        )
        stack.callback(stop, frontend)
        serving = next(e for e in log_lines(frontend) if e.get("event") == "serving")
        assert serving["tracing"] is True
        url = f"http://127.0.0.1:{serving['port']}"
        wait_ready(url)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
        request = urllib.request.Request(
            url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
        )
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            assert response.status == 200
        # A SIGTERM'd daemon flushes the spans still queued before it exits.
        stop(frontend)
        stop(sidecar)
    with spans.lock:
        got = [(service, span.name, span.trace_id.hex()) for service, span in spans.spans]
    assert ("my-frontend", "POST /generate", CLIENT_TRACE) in got, got
    assert ("my-frontend", "sidecar.v1.Worker/Generate", CLIENT_TRACE) in got, got
    assert ("sidecar-vllm", "sidecar.v1.Worker/Generate", CLIENT_TRACE) in got, got
