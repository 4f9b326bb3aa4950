"""One answer from SGLang (``OutputOptions.unary``): the engine is asked with ``stream`` false on
either wire, and the one output equals what the stream would join to, field for field.

The engine side is the testkit's rendering of SGLang's tokenizer manager (``RequestState``: a
stream's events, cumulative or incremental, or the one whole answer), driven by the request
as each wire carries it; the sidecar side decodes each wire (gRPC bytes through
``GrpcEventDecoder``, an HTTP JSON object through ``event_from_http``) into
:class:`~sidecar_sglang.convert_response.ResponseState`. The join is the relay's own
(:func:`sidecar_server.coalesce.merge_outputs`), so "equal" is message equality, presence
included. Then the errors a non-streaming request meets instead of an ``abort`` finish.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.generator import EOS_TRIGGER_TOKEN, PIECES, GeneratedToken, Generator, ModelSpec
from testkit.sglang_checks import check_request
from testkit.sglang_core import NativeRequest as EngineRequest
from testkit.sglang_core import Now, RequestState, chosen_ids, sampling_spec
from testkit.sglang_grpc import native_request_from_proto, response_from_out
from testkit.sglang_http import native_request_from_json
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason
from sidecar_server.coalesce import merge_outputs
from sidecar_sglang.convert_request import (
    NativeRequest,
    RequestSettings,
    Transport,
    asks_one_answer,
    build_native,
    to_grpc,
    to_http_json,
)
from sidecar_sglang.convert_response import ResponseState, answer_error, event_from_http
from sidecar_sglang.grpc_events import GrpcEventDecoder
from sidecar_sglang.refusals import generate_error

Out = sidecar_pb2.LLMEngineOutput
MODEL = ModelSpec()
EOS = MODEL.eos_token_ids[0]
NOW = Now(wall=1.0, mono=1.0)


@dataclass(frozen=True)
class Case:
    request: sidecar_pb2.PreprocessedRequest
    transport: Transport
    incremental: bool  # the server's --incremental-streaming-output
    chunk_tokens: int  # tokens per event of a stream
    cached: int


def _engine_request(native: NativeRequest, transport: Transport) -> EngineRequest:
    """The request as the testkit engine reads it off the wire and checks it (its defaults)."""
    if transport == "grpc":
        read = native_request_from_proto(to_grpc(native), native.rid)
    else:
        read = native_request_from_json(to_http_json(native), native.rid, 0)
    checked, refusal = check_request(SglangEngineConfig(), read)
    assert refusal is None
    return checked


def _engine_outs(request: EngineRequest, case: Case) -> list[tuple[dict[str, Any], bool]]:
    """SGLang's outputs for ``request`` (the testkit engine's scheduler loop, uninterrupted)."""
    state = RequestState(request, MODEL, case.incremental, started=0.0)
    state.cached = case.cached
    gen = Generator(MODEL, request.input_ids, sampling_spec(request))
    if gen.limit <= 0 and chosen_ids(request):
        ahead = Generator(MODEL, request.input_ids, replace(sampling_spec(request), max_tokens=1)).step()
        if ahead.logprobs is not None:
            state.take_logprobs(ahead.logprobs, token=False)
    outs: list[tuple[dict[str, Any], bool]] = []
    finished: GeneratedToken | None = None
    while gen.limit > 0 and not gen.done:
        token = gen.step()
        state.take(token)
        if token.finish is not None:
            finished = token
            break
        if state.unsent >= case.chunk_tokens:
            chunk = state.flush(NOW)
            if chunk is not None:
                outs.append((chunk.out, chunk.finished))
    chunks, _ = state.finish(finished, None, NOW)
    return outs + [(chunk.out, chunk.finished) for chunk in chunks]


def _served(case: Case, unary: bool) -> tuple[list[Out], bool]:
    """The sidecar's outputs for the case asked ``unary`` (or not), and whether the engine was
    asked to stream."""
    request = sidecar_pb2.PreprocessedRequest()
    request.CopyFrom(case.request)
    request.output_options.unary = unary
    native = build_native(request, "private", RequestSettings(transport=case.transport), room=0)
    cumulative = not case.incremental or not native.stream
    state = ResponseState(native, cumulative=cumulative)
    decode = GrpcEventDecoder(native, cumulative=cumulative).decode
    outs: list[Out] = []
    for out, finished in _engine_outs(_engine_request(native, case.transport), case):
        if case.transport == "grpc":
            event = decode(response_from_out(out, finished).SerializeToString())
        else:
            event = event_from_http(json.loads(json.dumps(out)))
        outs += state.feed(event, aborted_by_us=False)
    assert state.done
    return outs, native.stream


@st.composite
def cases(draw: st.DrawFn) -> Case:
    transport: Transport = draw(st.sampled_from(["grpc", "http"]))
    body = draw(st.lists(st.integers(100, 2000), min_size=1, max_size=6))
    if draw(st.booleans()):
        body = [EOS_TRIGGER_TOKEN, draw(st.integers(1, 6)), *body]
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=body, eos_token_ids=[EOS])
    stop = request.stop_conditions
    # Mostly a small budget: SGLang's default (128) makes long cumulative streams, slow here.
    max_tokens = (
        draw(st.integers(1, 14) | st.none()) if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, 14))
    )
    if max_tokens is not None:
        stop.max_tokens = max_tokens
    min_tokens = draw(st.none() | st.integers(0, min(3, max_tokens or 3)))
    if min_tokens is not None:
        stop.min_tokens = min_tokens
    stop.stop_token_ids.extend(draw(st.lists(st.integers(100, 140), max_size=3)))
    stop.stop.extend(draw(st.lists(st.sampled_from(PIECES[:12]), max_size=2)))
    stop.stop_token_ids_hidden.append(EOS)
    ignore_eos = draw(st.none() | st.booleans())
    if ignore_eos is not None:
        stop.ignore_eos = ignore_eos
    seed = draw(st.none() | st.integers(0, 2**31 - 1))
    if seed is not None:
        request.sampling_options.seed = seed
    logprobs = draw(st.none() | st.integers(0, 3))
    if logprobs is not None:
        request.output_options.logprobs = logprobs
    if draw(st.booleans()):
        request.output_options.prompt_logprobs = logprobs or 0
    if transport == "http" and logprobs is not None and draw(st.booleans()):
        request.output_options.token_ids_logprob.extend(draw(st.lists(st.integers(0, 400), max_size=3)))
    return Case(
        request,
        transport,
        incremental=draw(st.booleans()),
        chunk_tokens=draw(st.integers(1, 4)),
        cached=draw(st.integers(0, len(body))),
    )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_one_output_equals_the_joined_stream(case: Case) -> None:
    streamed, asked_stream = _served(case, unary=False)
    answered, answer_streamed = _served(case, unary=True)
    assert asked_stream
    assert not answer_streamed
    (answer,) = answered
    assert answer.finish_reason != sidecar_pb2.UNSPECIFIED, "the one output is the terminal"
    assert answer == merge_outputs(streamed)


# ------------------------------------------------------------------------------ tables


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize(
    ("unary", "mode", "stream"),
    [
        (False, "agg", True),
        (True, "agg", False),
        # A prefill's handoff goes out as SGLang admits it (HTTP); a decode's cancel hold needs
        # its first token: both stream.
        (True, "prefill", True),
        (True, "decode", True),
    ],
)
def test_the_engine_is_asked_for_one_answer_only_by_an_aggregated_worker(
    transport: Transport, unary: bool, mode: DisaggregationMode, stream: bool
) -> None:
    request = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[100, 101])
    request.output_options.unary = unary
    assert asks_one_answer(request, mode) is not stream
    if mode == "decode":
        request.bootstrap_info.bootstrap_host = "h"
    settings = RequestSettings(mode=mode, transport=transport, bootstrap_host="h", bootstrap_port=1)
    native = build_native(request, "private", settings, room=1)
    assert native.stream is stream
    assert to_grpc(native).stream is stream
    assert to_http_json(native)["stream"] is stream


# FastAPI's error body for an HTTPException SGLang's tokenizer manager raised.
def _raised(status: int, message: str) -> dict[str, object]:
    return {"object": "error", "message": message, "type": str(status), "param": None, "code": status}


@pytest.mark.parametrize(
    ("status", "payload", "reason", "message"),
    [
        # The scheduler's "busy" abort, raised for a non-streaming request: busy, as in a stream.
        (
            503,
            _raised(503, "The request queue is full."),
            FailureReason.OVERLOADED,
            "The request queue is full.",
        ),
        # A 503 in any other shape (a proxy, a server not up): as every 503 reads.
        (503, {"detail": "Service Unavailable"}, FailureReason.CANNOT_CONNECT, None),
        (503, None, FailureReason.CANNOT_CONNECT, None),
        # A 400 abort is raised as a ValueError: a refusal in SGLang's words, as in a stream.
        (
            400,
            {"error": {"message": "bad logprob_start_len"}},
            FailureReason.INVALID_ARGUMENT,
            "bad logprob_start_len",
        ),
        (500, _raised(500, "mm input failed"), FailureReason.UNKNOWN, None),
    ],
)
def test_an_answer_that_is_not_200_reads_as_the_abort_it_is(
    status: int, payload: object, reason: FailureReason, message: str | None
) -> None:
    words = "fallback words"
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        words = str(inner.get("message", inner.get("detail")) if isinstance(inner, dict) else inner)
    error = answer_error(status, payload, words)
    assert error.reason is reason
    if message is not None:
        assert error.message == message
        assert error.origin is not None


INTERNAL = grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("details", "unary", "reason", "message"),
    [
        # Starlette's text of the HTTPException the tokenizer manager raises for a 503 abort.
        ("503: The request queue is full.", True, FailureReason.OVERLOADED, "The request queue is full."),
        ("429: slow down", True, FailureReason.INVALID_ARGUMENT, "slow down"),
        # A 500 abort stays an engine failure.
        ("500: mm input failed", True, FailureReason.UNKNOWN, None),
        # The same text on a stream is no raised abort (a stream's aborts are terminals).
        ("503: The request queue is full.", False, FailureReason.UNKNOWN, None),
        # A 400 abort is a bare ValueError text: nothing tells it from a failure.
        ("bad logprob_start_len", True, FailureReason.UNKNOWN, None),
        ("503 The request queue is full.", True, FailureReason.UNKNOWN, None),
    ],
)
def test_a_non_streaming_grpc_call_reads_the_abort_sglang_raised(
    details: str, unary: bool, reason: FailureReason, message: str | None
) -> None:
    error = generate_error(INTERNAL, details, [100, 101], unary=unary)
    assert error.reason is reason
    if message is not None:
        assert error.message == message
        assert error.origin is not None
