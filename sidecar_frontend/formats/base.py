"""The contract between the format-agnostic HTTP handler and a format plugin.

A plugin is pure (no I/O, no clock, no globals, no logging): the handler passes in everything
that varies (the body bytes, the headers, what the workers serve, the time, fresh ids) and
gets back plain values: sub-requests to run, bytes to write, a reply to send. That is why a
plugin can be tested exhaustively, and why a third format touches no handler code.

Life of one generate call, as the handler drives it:

1. ``fmt.read_generate(route, body, headers)`` parses the body once, as the format's web
   framework does, into a :class:`GenerateBody` (the parsed body and the model it names, from
   which the handler chooses the model the request runs on), or refuses it (an
   :class:`HttpReply`).
2. ``fmt.parse_generate(route, read, headers, ctx)`` judges that parsed body against ``ctx``
   (the chosen model's) and returns a :class:`GenerateCall` (the ``sidecar.v1`` sub-requests
   to run, in the format's response order, plus the plugin's own response options) or an
   :class:`HttpReply` (a refusal in the format's error shape; nothing reaches a worker).
   :func:`parse_whole` runs both steps, for callers whose model is already known.
3. The handler runs every sub-request on a worker and creates one encoder with
   ``fmt.new_encoder(call, started_at)``.
4. For each ``LLMEngineOutput`` of sub-request ``i`` the handler calls
   ``encoder.on_output(i, output, now)``; for a sub-request that failed, ``encoder.on_failure(i,
   failure, now)``. In streaming mode both return the bytes to write now (possibly ``b""``);
   in unary mode they return ``b""`` and the encoder accumulates.
5. Streaming: once every sub-request has ended, the handler writes ``encoder.close()``.
   Unary: the handler sends ``encoder.reply()``.

A client that reads slower than the stream comes (the HTTP transport's buffer is full): an
encoder that is also a :class:`HoldingEncoder` is given the outputs with ``encoder.hold(i,
output, now)`` instead, which takes them into its state and writes only what must not wait;
once the client has read what was written, ``encoder.flush(now)`` writes the held tokens, each
choice's in one event. A client that keeps up never sees a held event: its bytes are those of
``on_output`` alone.

The encoder decides whether a failure ends the whole HTTP response: after ``on_failure``
returns, the handler asks ``encoder.aborted``; when true it cancels the other sub-requests and
finishes (streaming: writes ``close()``; unary: sends ``reply()``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import ENGINE_NOT_FOUND, FAILURE_RULES, FailureReason, SidecarError

__all__ = [
    "AbortCall",
    "Encoder",
    "Format",
    "FormatContext",
    "GenerateBody",
    "GenerateCall",
    "HoldingEncoder",
    "HttpReply",
    "Route",
    "RouteKind",
    "WorkerFailure",
    "named_model",
    "parse_whole",
]

JSON_CONTENT_TYPE = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


class RouteKind(enum.Enum):
    GENERATE = "generate"
    ABORT = "abort"
    INFO = "info"  # answered from FormatContext alone by Format.info


@dataclass(frozen=True)
class Route:
    methods: tuple[str, ...]
    path: str
    kind: RouteKind


@dataclass(frozen=True)
class HttpReply:
    """A complete HTTP answer (a refusal, an info endpoint, a unary response)."""

    status: int
    body: bytes
    content_type: str = JSON_CONTENT_TYPE
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class FormatContext:
    """What the handler knows when a request arrives; everything a pure plugin may consult.

    ``new_id`` returns a fresh random id (32 lowercase hex characters) each call: the one
    source of randomness, injected so that tests can make it deterministic.
    """

    model_info: sidecar_pb2.ModelInfo
    new_id: Callable[[], str]
    # Request ids currently in flight at this frontend (SGLang refuses a duplicate rid): a live
    # view, not a copy (a copy per request costs in proportion to the requests in flight).
    inflight_ids: Container[str] = frozenset()
    # Unix seconds (time.time()) when the request arrived: for wall-clock values a body
    # carries (SGLang's response_sent_to_client_ts, a model card's created). The encoder's
    # ``now``/``started_at`` stay on the handler's monotonic clock; 0.0: not given.
    wall_time: float = 0.0
    # Every model the fleet serves now, ``model_info`` among them (``/v1/models`` lists
    # them); empty: ``model_info`` alone.
    models: tuple[sidecar_pb2.ModelInfo, ...] = ()
    # The fleet's newest weight version (an admin call's, else the newest a worker reported:
    # sidecar_frontend/fleet.py); None: no worker reported one and none was set.
    weight_version: str | None = None


@dataclass(frozen=True)
class GenerateBody:
    """A generate body as the format's web framework parsed it: parsed once, handed on.

    ``data`` is what the format's own stages take next (opaque to the handler: a JSON value,
    or the raw bytes of a body the framework does not parse as JSON). ``model`` is the model
    the body names (:func:`named_model`), by which the handler chooses the model to run on.
    """

    data: object
    model: str | None = None


@dataclass(frozen=True)
class GenerateCall:
    """A parsed generate request: what to run and how to answer.

    ``requests`` are the ``sidecar.v1`` sub-requests, in the format's response order (an
    SGLang batch of P prompts with n samples gives P*n of them, prompt-major). Each has its
    ``request_id`` set to the id the client will see and can abort by.
    ``options`` is the plugin's own response state (opaque to the handler).
    """

    requests: Sequence[sidecar_pb2.PreprocessedRequest]
    stream: bool
    options: object = None
    # Extra response headers (e.g. vLLM echoes X-Request-Id).
    headers: tuple[tuple[str, str], ...] = ()
    # Streaming: the failure reasons the server answers before its stream starts (vLLM's
    # admission refusal). When any, the handler holds the 200 until the first bytes of the
    # stream; a failure of one of these reasons that ends the response before them is the
    # plain reply of :meth:`Encoder.reply` instead, as the server's.
    refused_before_stream: frozenset[FailureReason] = frozenset()


@dataclass(frozen=True)
class WorkerFailure:
    """Why a sub-request ended without its terminal(s): the sidecar's typed error.

    ``reason`` is the sidecar's (its ErrorInfo reason) or, for failures the frontend itself
    decides, NO_WORKER (no serving worker) and DEADLINE (the frontend's
    --request-timeout-secs ran out). ``message`` is the status detail text. ``from_engine``:
    the message is the engine's own text, unchanged (ErrorInfo metadata ``origin: engine``),
    which a format shows to the client as it is; ``engine_status`` is then what the engine
    answered (metadata ``engine_status``: a gRPC code name, an HTTP status, ``not sent``).
    ``misbehaved``: the worker sent what no sidecar may (``sidecar_frontend.misbehaviour``):
    another worker takes the request while nothing was delivered; never migrated after.
    """

    reason: FailureReason
    message: str
    migratable: bool = False
    from_engine: bool = False
    engine_status: str = ""
    misbehaved: bool = False

    @classmethod
    def of(cls, reason: FailureReason, message: str) -> WorkerFailure:
        """A failure the frontend decides itself, migratable as its reason's rule says."""
        return cls(reason, message, FAILURE_RULES[reason].migratable)

    @classmethod
    def from_error(cls, error: SidecarError) -> WorkerFailure:
        """A sidecar's typed error (:func:`~sidecar_common.errors.decode_rpc_error`)."""
        origin = error.origin
        return cls(
            error.reason,
            error.message,
            error.migratable,
            from_engine=origin is not None,
            engine_status=origin.status if origin is not None else "",
        )

    @property
    def not_found(self) -> bool:
        """The engine refused because it does not have what the request names (a LoRA
        adapter, a model): its status was gRPC NOT_FOUND or HTTP 404."""
        return self.from_engine and self.engine_status in ENGINE_NOT_FOUND


@dataclass(frozen=True)
class AbortCall:
    """The ids an abort request names (``all_requests``: abort everything in flight)."""

    request_ids: tuple[str, ...] = ()
    all_requests: bool = False
    # SGLang's rule: an id that names a request in flight also aborts every request in flight
    # whose id starts with it; an id naming none aborts nothing.
    by_prefix: bool = False


class Encoder(Protocol):
    """The response state machine for one generate call (see the module docstring)."""

    @property
    def aborted(self) -> bool:
        """True once a failure ended the whole response (the handler stops the rest)."""
        ...

    def on_output(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes: ...

    def on_failure(self, index: int, failure: WorkerFailure, now: float) -> bytes: ...

    def close(self) -> bytes:
        """Streaming: the bytes that end the stream (e.g. ``data: [DONE]\\n\\n``)."""
        ...

    def reply(self) -> HttpReply:
        """Unary: the whole response, once every sub-request ended (or one aborted it)."""
        ...


@runtime_checkable
class HoldingEncoder(Encoder, Protocol):
    """An encoder that can carry several outputs' tokens in one event while the client reads
    slower than the stream comes (the handler decides when: never while the client keeps up).

    Held tokens are never lost nor reordered: whatever ends a choice (its terminal, a failure)
    writes its held tokens first or with it, ``on_output`` writes them before anything newer of
    that choice, and the events of one choice joined carry the same tokens as without holding
    (the format's laws hold for an output of any number of tokens)."""

    def hold(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        """As :meth:`Encoder.on_output` (it raises on the same outputs), but the output's tokens
        wait for :meth:`flush`; returns only what must be written now (a choice's end)."""
        ...

    def flush(self, now: float) -> bytes:
        """Every held token, one event per choice, that the format allows to go out now."""
        ...


class Format(Protocol):
    """One HTTP format. Module-level singletons; no state of their own."""

    name: str
    routes: Sequence[Route]

    def read_generate(
        self, route: Route, body: bytes, headers: Mapping[str, str]
    ) -> GenerateBody | HttpReply:
        """The body parsed once, as the format's framework parses it, or its refusal."""
        ...

    def parse_generate(
        self, route: Route, body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext
    ) -> GenerateCall | HttpReply:
        """The body :meth:`read_generate` parsed, judged against the model it runs on."""
        ...

    def new_encoder(self, call: GenerateCall, started_at: float) -> Encoder: ...

    def parse_abort(self, route: Route, body: bytes, headers: Mapping[str, str]) -> AbortCall | HttpReply: ...

    def abort_reply(self, route: Route, call: AbortCall, aborted: int) -> HttpReply: ...

    def info(self, route: Route, ctx: FormatContext) -> HttpReply: ...

    def error_reply(self, status: int, message: str) -> HttpReply:
        """A handler-level refusal (no worker, overload, bad method) in this format's shape."""
        ...

    def model_not_found(self, model: str, served: Sequence[str]) -> HttpReply:
        """404: the request names ``model``, which no worker serves (``served`` are)."""
        ...


def named_model(data: object) -> str | None:
    """The model a parsed generate body names in its top-level ``model`` (vLLM's field;
    SGLang's server has none and ignores it, while its router, sgl-model-gateway, routes by
    it), or None when it names none (or the body is not a JSON object: the format refuses it)."""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def parse_whole(
    fmt: Format, route: Route, body: bytes, headers: Mapping[str, str], ctx: FormatContext
) -> GenerateCall | HttpReply:
    """``read_generate`` then ``parse_generate``: a body's whole judgment when the model it runs
    on is known beforehand (the handler chooses it between the two steps)."""
    read = fmt.read_generate(route, body, headers)
    if isinstance(read, HttpReply):
        return read
    return fmt.parse_generate(route, read, headers, ctx)
