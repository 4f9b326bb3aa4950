"""One trace from the HTTP client through the frontend and the sidecar to the engine, in
process: the real frontend app, a real sidecar server and adapter, a testkit engine on each
wire (vLLM gRPC metadata, SGLang gRPC ``trace_headers``, SGLang HTTP headers), and
OpenTelemetry's in-memory exporter standing in for the OTLP collector."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from testkit.book import Book

from sidecar_common.tracing import Tracing
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)

WIRES = ["vllm", "sglang-grpc", "sglang-http"]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque"


@dataclass
class Traced:
    fleet: FrontendStack
    book: Book  # the engine's
    spans: InMemorySpanExporter | None  # None: nothing exported


def _tracing(exporter: InMemorySpanExporter, service: str) -> Tracing:
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


@asynccontextmanager
async def traced_fleet(wire: str, *, exporting: bool) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter() if exporting else None
    frontend_tracing = _tracing(exporter, "sidecar-frontend") if exporter else Tracing()
    sidecar_tracing = _tracing(exporter, "sidecar") if exporter else Tracing()
    async with AsyncExitStack() as stack:
        sidecar: Any
        if wire == "vllm":
            sidecar = await stack.enter_async_context(vllm_stack(tracing=sidecar_tracing))
        else:
            transport = wire.removeprefix("sglang-")
            sidecar = await stack.enter_async_context(sglang_stack(transport, tracing=sidecar_tracing))  # type: ignore[arg-type]
        address = f"127.0.0.1:{sidecar.server.port}"
        fleet = await stack.enter_async_context(
            frontend_over([address], [sidecar], formats=(SGLANG,), tracing=frontend_tracing)
        )
        yield Traced(fleet, sidecar.engine.book, exporter)


async def _generate(fleet: FrontendStack, headers: dict[str, str]) -> None:
    body = {"input_ids": [101, 202, 303], "sampling_params": {"max_new_tokens": 3}}
    async with fleet.http.post(fleet.url + "/generate", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        assert len((await response.json())["output_ids"]) == 3


def _engine_context(book: Book) -> dict[str, str]:
    """The one trace context the engine received."""
    assert len(book.trace_context) == 1, book.trace_context
    return next(iter(book.trace_context.values()))


def _parse(traceparent: str) -> tuple[str, str]:
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00"
    assert int(flags, 16) & 1  # sampled
    return trace_id, parent_id


def _one(spans: list[ReadableSpan], service: str, kind: SpanKind) -> ReadableSpan:
    found = [s for s in spans if s.resource.attributes[SERVICE_NAME] == service and s.kind is kind]
    assert len(found) == 1, [(s.name, s.kind, s.resource.attributes) for s in spans]
    return found[0]


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


@pytest.mark.parametrize("wire", WIRES)
async def test_the_clients_trace_runs_through_frontend_sidecar_and_engine(wire: str) -> None:
    async with traced_fleet(wire, exporting=True) as traced:
        await _generate(traced.fleet, {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        assert traced.spans is not None
        spans = list(traced.spans.get_finished_spans())
        received = _engine_context(traced.book)
    http = _one(spans, "sidecar-frontend", SpanKind.SERVER)
    call = _one(spans, "sidecar-frontend", SpanKind.CLIENT)
    sidecar = _one(spans, "sidecar", SpanKind.SERVER)
    # One trace, each hop the child of the one before.
    for span in (http, call, sidecar):
        assert span.context is not None
        assert _hex(span.context.trace_id, 32) == CLIENT_TRACE
    assert http.parent is not None
    assert _hex(http.parent.span_id, 16) == CLIENT_SPAN
    assert call.parent is not None
    assert http.context is not None
    assert call.parent.span_id == http.context.span_id
    assert sidecar.parent is not None
    assert call.context is not None
    assert sidecar.parent.span_id == call.context.span_id
    assert sidecar.context is not None
    assert _parse(received["traceparent"]) == (CLIENT_TRACE, _hex(sidecar.context.span_id, 16))
    assert received["tracestate"] == TRACESTATE
    assert http.name == "POST /generate"
    assert http.attributes is not None
    assert http.attributes["http.response.status_code"] == 200
    assert call.attributes is not None
    assert call.attributes["server.address"] == traced.fleet.address(0)


@pytest.mark.parametrize("wire", WIRES)
async def test_a_request_without_a_trace_starts_one_at_the_frontend(wire: str) -> None:
    async with traced_fleet(wire, exporting=True) as traced:
        await _generate(traced.fleet, {})
        assert traced.spans is not None
        spans = list(traced.spans.get_finished_spans())
        received = _engine_context(traced.book)
    http = _one(spans, "sidecar-frontend", SpanKind.SERVER)
    sidecar = _one(spans, "sidecar", SpanKind.SERVER)
    assert http.parent is None  # a new trace, rooted at the frontend
    assert http.context is not None
    assert sidecar.context is not None
    assert sidecar.context.trace_id == http.context.trace_id
    assert _parse(received["traceparent"]) == (
        _hex(http.context.trace_id, 32),
        _hex(sidecar.context.span_id, 16),
    )


@pytest.mark.parametrize("wire", WIRES)
async def test_without_an_exporter_the_clients_context_reaches_the_engine_unchanged(wire: str) -> None:
    async with traced_fleet(wire, exporting=False) as traced:
        await _generate(traced.fleet, {"Traceparent": TRACEPARENT, "tracestate": TRACESTATE})
        assert _engine_context(traced.book) == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
        # And a request that carries none sends none.
        traced.book.trace_context.clear()
        await _generate(traced.fleet, {})
        assert traced.book.trace_context == {}
