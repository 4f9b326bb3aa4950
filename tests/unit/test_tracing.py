"""sidecar_common/tracing.py: when spans are exported, and the context carried in and out."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from sidecar_common.tracing import Tracing, from_headers, from_metadata, outgoing_headers, outgoing_metadata

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("environ", "exporting"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_spans_are_exported_only_when_an_otlp_endpoint_is_set(
    environ: dict[str, str], exporting: bool
) -> None:
    tracing = Tracing.from_environment(environ, service="test")
    try:
        assert tracing.exporting is exporting
    finally:
        tracing.shutdown()


def test_trace_fields_are_picked_from_headers_and_metadata() -> None:
    assert from_headers({"traceparent": TRACEPARENT, "x-other": "1"}) == {"traceparent": TRACEPARENT}
    assert from_metadata([("traceparent", TRACEPARENT), ("tracestate", "a=1"), ("bin", b"\x00")]) == {
        "traceparent": TRACEPARENT,
        "tracestate": "a=1",
    }
    assert from_metadata(None) == {}


def test_without_an_exporter_the_incoming_context_goes_out_unchanged_and_none_stays_none() -> None:
    tracing = Tracing()
    with tracing.span("x", {"traceparent": TRACEPARENT, "tracestate": "a=1"}) as span:
        assert span is None
        assert outgoing_headers() == {"traceparent": TRACEPARENT, "tracestate": "a=1"}
        assert outgoing_metadata() == (("traceparent", TRACEPARENT), ("tracestate", "a=1"))
    assert outgoing_headers() == {}
    with tracing.span("x", {}) as span:
        assert span is None
        assert outgoing_metadata() is None


def test_a_malformed_traceparent_starts_a_new_trace() -> None:
    tracing = Tracing(TracerProvider())
    with tracing.span("x", {"traceparent": "00-not-a-trace-01"}) as span:
        assert span is not None
        parent = getattr(span, "parent", None)
        assert parent is None
        assert outgoing_headers()["traceparent"].split("-")[1] == format(
            span.get_span_context().trace_id, "032x"
        )
