"""One trace per request, from the HTTP frontend through the sidecar to the engine.

W3C trace context (``traceparent``, ``tracestate``) comes in with a request (HTTP headers at
the frontend, gRPC metadata at the sidecar) and goes out with each call it makes (gRPC
metadata to a sidecar or to vLLM, ``GenerateRequest.trace_headers`` on SGLang's gRPC wire,
HTTP headers to SGLang's HTTP server). The context travels in OpenTelemetry's context (a
contextvar), so the engine adapters read it where they build their call, with no parameter
through the layers between.

:class:`Tracing` is one per process. With an exporter (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set: :meth:`Tracing.from_environment`) it records spans
and exports them over OTLP/gRPC; without one it records nothing, and a context a client sent
passes through unchanged (the engine's own spans still join the client's trace). A request
that carries no ``traceparent`` then costs one header look-up per hop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Final

import anyio
import anyio.to_thread
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "TRACE_FIELDS",
    "Tracing",
    "from_headers",
    "from_metadata",
    "outgoing_headers",
    "outgoing_metadata",
]

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
TRACE_FIELDS: Final = (TRACEPARENT, TRACESTATE)

# The variables that turn exporting on (the OpenTelemetry SDK's own names; the exporter
# reads them, and OTEL_EXPORTER_OTLP_HEADERS, _CERTIFICATE, _INSECURE, _TIMEOUT..., itself).
ENDPOINT_VARIABLES: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_PROPAGATOR: Final = TraceContextTextMapPropagator()
SpanKind = trace.SpanKind


def from_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace fields of HTTP headers (a case-insensitive mapping, as aiohttp's)."""
    found: dict[str, str] = {}
    for name in TRACE_FIELDS:
        value = headers.get(name)
        if value is not None:
            found[name] = value
    return found


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The trace fields of gRPC metadata (whose keys are lower-case)."""
    found: dict[str, str] = {}
    for name, value in metadata or ():
        if name in TRACE_FIELDS and isinstance(value, str):
            found[name] = value
    return found


class Tracing:
    """Spans and context propagation for one process (``Tracing()``: export nothing)."""

    def __init__(self, provider: trace.TracerProvider | None = None, *, name: str = "llm-sidecars") -> None:
        self._provider = provider
        self._tracer: trace.Tracer | None = provider.get_tracer(name) if provider is not None else None

    @property
    def exporting(self) -> bool:
        return self._tracer is not None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], *, service: str) -> Tracing:
        """Export over OTLP/gRPC when an endpoint variable is set (``OTEL_SDK_DISABLED=true``
        or ``OTEL_TRACES_EXPORTER=none`` turn it off); ``OTEL_SERVICE_NAME`` names the
        service, ``service`` when unset. Spans leave in batches, off the request path."""
        if not any(environ.get(v, "").strip() for v in ENDPOINT_VARIABLES):
            return cls()
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            return cls()
        # Imported only when exporting: a process that does not export never loads the SDK.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME") or service})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def shutdown(self) -> None:
        """Flush the spans still queued (bounded by the SDK's own export timeout); blocks."""
        shutdown = getattr(self._provider, "shutdown", None)
        if callable(shutdown):
            shutdown()

    async def aclose(self) -> None:
        """:meth:`shutdown` off the event loop (the caller bounds it)."""
        if self._provider is not None:
            await anyio.to_thread.run_sync(self.shutdown, abandon_on_cancel=True)

    @contextmanager
    def span(
        self,
        name: str,
        incoming: Mapping[str, str] | None = None,
        *,
        kind: trace.SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Iterator[trace.Span | None]:
        """Run the block inside a span named ``name``, child of the context in ``incoming``
        (:func:`from_headers`, :func:`from_metadata`; none: of the current context, or a new
        trace). Without an exporter no span is made: the incoming context alone is made
        current (so it goes out unchanged), and the block gets None."""
        parent = _PROPAGATOR.extract(incoming) if incoming else None
        tracer = self._tracer
        if tracer is None:
            if parent is None:
                yield None
                return
            token = otel_context.attach(parent)
            try:
                yield None
            finally:
                otel_context.detach(token)
            return
        with tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as span:
            yield span


def outgoing_headers() -> dict[str, str]:
    """The current trace context as ``traceparent`` (and ``tracestate``) entries; empty when
    there is none."""
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC metadata, or None when there is none."""
    headers = outgoing_headers()
    return tuple(headers.items()) if headers else None
