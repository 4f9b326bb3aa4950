"""Laws of the vLLM format plugin, checked over generated requests and engine outputs.

* Fold: the unary reply equals the streamed chunks folded, field by field, with and without
  usage chunks, whatever the interleaving of choices and however the request ends.
* Round trip: opaque values (kv_transfer_params, request ids) survive untouched; explicit
  nulls inside them stay; a sampling key is set downstream exactly when the caller sent it.
* Refusals: every field the format cannot carry is refused with 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_common.structs import JSON, json_from_struct, struct_from_json
from sidecar_frontend.formats.base import HttpReply, WorkerFailure
from sidecar_frontend.formats.vllm import ABORT, FORMAT
from tests.unit.frontend.test_format_vllm_support import (
    JSON_HEADERS,
    accepted,
    context,
    error_of,
    parse,
    refused,
    sse_events,
)

TERMINALS = ["length", "stop_token", "stop_string", "eos", "cancelled", None]
ENDINGS: list[FailureReason | None] = [
    None,
    FailureReason.CANCELLED,
    FailureReason.DEADLINE,
    FailureReason.INVALID_ARGUMENT,
    FailureReason.OVERLOADED,
    FailureReason.ENGINE_SHUTDOWN,
    FailureReason.UNKNOWN,
]


@st.composite
def generations(draw: st.DrawFn) -> dict[str, Any]:
    """A request's options and its engine outputs for every choice, interleaved in some order."""
    n = draw(st.integers(1, 3))
    logprobs = draw(st.booleans())
    # Token ids: now and then the EOS (2) or the listed stop id (7), so that chunks that may
    # end their choice (and are held for its terminal) come up.
    tokens = st.integers(0, 31999) | st.sampled_from([2, 7])
    choices: list[list[sidecar_pb2.LLMEngineOutput]] = []
    finished = True
    for index in range(n):
        deltas = draw(st.lists(st.lists(tokens, max_size=3), max_size=4))
        outputs = [_output(index, ids, logprobs, draw) for ids in deltas]
        terminal = draw(st.sampled_from(TERMINALS))
        finished = finished and terminal is not None
        if terminal is not None:
            last = _output(index, draw(st.lists(tokens, max_size=2)), logprobs, draw)
            _finish(last, terminal)
            outputs.append(last)
        choices.append(outputs)
    order: list[sidecar_pb2.LLMEngineOutput] = []
    while any(choices):
        pick = draw(st.sampled_from([i for i, c in enumerate(choices) if c]))
        order.append(choices[pick].pop(0))
    # The sidecar ends every choice with a terminal, or the call with a failure.
    ending = None if finished else draw(st.sampled_from(ENDINGS[1:]))
    return {
        "n": n,
        "logprobs": logprobs,
        "outputs": order,
        "ending": ending,
        "include_usage": draw(st.booleans()),
        "continuous": draw(st.booleans()),
        "return_token_ids": draw(st.booleans()),
        "limits": draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "max_tokens": st.integers(1, 8),
                    "min_tokens": st.integers(0, 3),
                    "stop_token_ids": st.just([7]),
                    "ignore_eos": st.booleans(),
                },
            ).filter(_min_within_max)
        ),
    }


def _min_within_max(limits: dict[str, object]) -> bool:
    low, high = limits.get("min_tokens", 0), limits.get("max_tokens", 8)
    return isinstance(low, int) and isinstance(high, int) and low <= high


def _output(index: int, ids: list[int], logprobs: bool, draw: st.DrawFn) -> sidecar_pb2.LLMEngineOutput:
    out = sidecar_pb2.LLMEngineOutput(token_ids=ids, index=index)
    if logprobs:
        for token in ids:
            value = draw(st.floats(-50, 0))
            out.log_probs.append(value)
            entries = out.top_logprobs.add().entries
            entries.add(token_id=token, logprob=value, rank=draw(st.integers(1, 5)))
            entries.add(token_id=draw(st.integers(0, 31999)), logprob=draw(st.floats(-50, 0)))
    return out


def _finish(out: sidecar_pb2.LLMEngineOutput, terminal: str) -> None:
    if terminal == "length":
        out.finish_reason = sidecar_pb2.LENGTH
    elif terminal == "stop_token":
        out.finish_reason, out.stop_token_id = sidecar_pb2.STOP, 7
    elif terminal == "stop_string":
        out.finish_reason, out.stop_string = sidecar_pb2.STOP, "</s>"
    elif terminal == "eos":
        out.finish_reason = sidecar_pb2.EOS
    else:
        out.finish_reason = sidecar_pb2.CANCELLED


def _run(case: dict[str, Any], stream: bool) -> Any:
    body = {
        "token_ids": [5, 6, 7],
        "sampling_params": {
            "n": case["n"],
            **({"logprobs": 2} if case["logprobs"] else {}),
            **case["limits"],
        },
        "stream": stream,
        "stream_options": {
            "include_usage": case["include_usage"],
            "continuous_usage_stats": case["continuous"],
        },
        "return_token_ids": case["return_token_ids"],
    }
    encoder = FORMAT.new_encoder(accepted(body), 100.0)
    data = b"".join(encoder.on_output(0, out, 101.0) for out in case["outputs"])
    if case["ending"] is not None:
        data += encoder.on_failure(0, WorkerFailure(case["ending"], "it ended"), 102.0)
    return data + encoder.close() if stream else (data, encoder.reply())


@given(generations())
def test_fold_the_stream_is_the_unary_reply_in_pieces(case: dict[str, Any]) -> None:
    unary_bytes, reply = _run(case, stream=False)
    assert unary_bytes == b""
    events = sse_events(_run(case, stream=True))
    assert events[-1] == "[DONE]"
    assert "[DONE]" not in events[:-1]
    unary = json.loads(reply.body)

    if reply.status != 200:
        # The error the unary client gets is the stream's last event, with the tokens before it.
        assert events[-2] == unary
        assert unary["error"]["code"] == reply.status
        events = events[:-2]
    else:
        events = events[:-1]

    usage_chunks = [e for e in events if e["choices"] == []]
    chunks = [e for e in events if e["choices"] != []]
    assert all(len(e["choices"]) == 1 for e in chunks)
    folded: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        into = folded.setdefault(
            choice["index"], {"token_ids": [], "content": [], "finish": None, "stop": None}
        )
        assert into["finish"] is None, "nothing after a choice's final chunk"
        into["token_ids"] += choice["token_ids"]
        if case["logprobs"]:
            into["content"] += choice["logprobs"]["content"]
        else:
            assert choice["logprobs"] is None
        into["finish"], into["stop"] = choice["finish_reason"], choice["stop_reason"]
    ids_first = [e for e in chunks if "prompt_token_ids" in e]
    assert ids_first == (chunks[:1] if case["return_token_ids"] else [])

    if reply.status != 200:
        return
    # Beside the fold, what both must say: every generated token, counted once.
    for choice in unary["choices"]:
        sent = [t for o in case["outputs"] if o.index == choice["index"] for t in o.token_ids]
        assert choice["token_ids"] == sent
    completion = sum(len(c["token_ids"]) for c in unary["choices"])
    assert unary["usage"]["completion_tokens"] == completion
    assert unary["usage"]["total_tokens"] == 3 + completion
    for choice in unary["choices"]:
        got = folded.get(choice["index"], {"token_ids": [], "content": [], "finish": None, "stop": None})
        assert got["token_ids"] == choice["token_ids"]
        assert got["content"] == (choice["logprobs"]["content"] if case["logprobs"] else [])
        assert (got["finish"] or "stop", got["stop"]) == (choice["finish_reason"], choice["stop_reason"])
    expected_usage = {k: unary["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
    if case["include_usage"]:
        assert usage_chunks == [
            {
                "request_id": unary["request_id"],
                "usage": expected_usage,
                "output_mode": "tokens",
                "choices": [],
            }
        ]
        assert events[-1] is usage_chunks[0]
    else:
        assert usage_chunks == []
    continuous = case["include_usage"] and case["continuous"]
    assert all((c["usage"] is not None) == continuous for c in chunks)
    assert {c["request_id"] for c in events} <= {unary["request_id"]}


# ------------------------------------------------------------------------------ round trip

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=4)


@given(json_objects, st.sampled_from(["agg", "prefill", "decode"]))
def test_kv_transfer_params_survive_the_trip_untouched(params: dict[str, JSON], mode: str) -> None:
    call = accepted(
        {"token_ids": [1], "sampling_params": {}, "kv_transfer_params": params},
        ctx=context(disaggregation_mode=mode),
    )
    (request,) = call.requests
    carried = (
        request.prefill_result.disaggregated_params
        if mode == "decode"
        else request.extra_args.fields["kv_transfer_params"].struct_value
    )
    assert json_from_struct(carried) == params
    # What a prefill worker hands back comes out as the unary response's kv_transfer_params.
    encoder = FORMAT.new_encoder(call, 0.0)
    terminal = sidecar_pb2.LLMEngineOutput(index=0, finish_reason=sidecar_pb2.LENGTH)
    terminal.disaggregated_params.CopyFrom(struct_from_json(params))
    encoder.on_output(0, terminal, 0.0)
    assert json.loads(encoder.reply().body)["kv_transfer_params"] == params


@given(st.text())
def test_the_clients_request_id_survives_into_the_response(request_id: str) -> None:
    call = accepted({"token_ids": [1], "sampling_params": {}, "request_id": request_id})
    encoder = FORMAT.new_encoder(call, 0.0)
    encoder.on_output(0, sidecar_pb2.LLMEngineOutput(index=0, finish_reason=sidecar_pb2.LENGTH), 0.0)
    assert json.loads(encoder.reply().body)["request_id"] == "generate-tokens-" + request_id
    assert call.requests[0].request_id == "generate-tokens-" + request_id


def _has(message: str, field: str) -> Callable[[sidecar_pb2.PreprocessedRequest], bool]:
    return lambda r: getattr(r, message).HasField(field)


# Each sampling key, valid values for it, and how to see it set on the PreprocessedRequest.
SAMPLING_KEYS: dict[str, tuple[st.SearchStrategy[Any], Callable[[sidecar_pb2.PreprocessedRequest], bool]]] = {
    "n": (st.just(1), _has("sampling_options", "n")),
    "temperature": (st.floats(0.5, 2), _has("sampling_options", "temperature")),
    "top_p": (st.floats(0.01, 1), _has("sampling_options", "top_p")),
    "top_k": (st.integers(-1, 100), _has("sampling_options", "top_k")),
    "min_p": (st.floats(0, 1), _has("sampling_options", "min_p")),
    "presence_penalty": (st.floats(-2, 2), _has("sampling_options", "presence_penalty")),
    "frequency_penalty": (st.floats(-2, 2), _has("sampling_options", "frequency_penalty")),
    "repetition_penalty": (st.floats(0.1, 2), _has("sampling_options", "repetition_penalty")),
    "seed": (st.integers(0, 2**31 - 1), _has("sampling_options", "seed")),
    "include_stop_str_in_output": (st.booleans(), _has("sampling_options", "include_stop_str_in_output")),
    "max_tokens": (st.integers(8, 100) | st.none(), _has("stop_conditions", "max_tokens")),
    "min_tokens": (st.integers(0, 8), _has("stop_conditions", "min_tokens")),
    "ignore_eos": (st.booleans(), _has("stop_conditions", "ignore_eos")),
    "logprobs": (st.integers(0, 20), _has("output_options", "logprobs")),
    "prompt_logprobs": (st.integers(0, 20), _has("output_options", "prompt_logprobs")),
    "skip_special_tokens": (st.booleans(), _has("output_options", "skip_special_tokens")),
}


@st.composite
def sampling_subsets(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.sets(st.sampled_from(sorted(SAMPLING_KEYS))))
    return {key: draw(SAMPLING_KEYS[key][0]) for key in keys}


@given(sampling_subsets())
def test_a_sampling_key_is_set_downstream_exactly_when_sent(sampling: dict[str, Any]) -> None:
    (request,) = accepted({"token_ids": [1, 2], "sampling_params": sampling}).requests
    for key, (_, is_set) in SAMPLING_KEYS.items():
        assert is_set(request) == (key in sampling), key


# -------------------------------------------------------------------------------- refusals

UNCARRIED: dict[str, tuple[str, st.SearchStrategy[Any]]] = {
    "ec_transfer_params": ("top", json_objects),
    # Shaped as vLLM's model requires (an arbitrary object is a validation error there).
    "features": ("top", st.just({"mm_hashes": {}, "mm_placeholders": {}})),
    "content_parts": ("top", st.lists(json_objects, min_size=1, max_size=2)),
    "logprob_token_ids": ("sampling", st.lists(st.integers(0, 10), max_size=3)),
    "prompt_logprob_token_ids": ("sampling", st.lists(st.lists(st.integers(0, 10), max_size=2), max_size=2)),
    "prompt_logprob_start": ("sampling", st.integers(0, 5)),
    "allowed_token_ids": ("sampling", st.lists(st.integers(0, 10), min_size=1, max_size=3)),
    "thinking_token_budget": ("sampling", st.integers(0, 100)),
    "repetition_detection": ("sampling", json_objects),
    "trace_decode_token_ids": ("sampling", st.lists(st.integers(0, 10), max_size=3)),
    "extra_args": ("sampling", json_objects.filter(bool)),
    "watermarking": ("sampling", st.just(True)),
}


@given(st.sampled_from(sorted(UNCARRIED)), st.data(), sampling_subsets())
def test_every_field_we_cannot_carry_is_refused_by_name(
    name: str, data: st.DataObject, sampling: dict[str, Any]
) -> None:
    where, values = UNCARRIED[name]
    value = data.draw(values)
    body: dict[str, Any] = {"token_ids": [1, 2], "sampling_params": dict(sampling)}
    if where == "top":
        body[name] = value
    else:
        body["sampling_params"][name] = value
    error = error_of(refused(body, JSON_HEADERS))
    assert error["code"] == 400
    assert error["param"] == name
    assert name in error["message"]


# ----------------------------------------------------------------------------- robustness

any_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**400])
    | st.floats()
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TOP_KEYS = [
    "token_ids",
    "sampling_params",
    "request_id",
    "stream",
    "stream_options",
    "output_mode",
    "model",
    "priority",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "return_token_ids",
    "features",
    "content_parts",
    "reasoning_ended",
]
SAMPLING_NAMES = [
    *SAMPLING_KEYS,
    "stop",
    "stop_token_ids",
    "logit_bias",
    "detokenize",
    "bad_words",
    "stream_interval",
    "extra_args",
    "structured_outputs",
    *(n for n in UNCARRIED),
]


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": draw(st.lists(st.integers(0, 40000), max_size=3) | any_json)}
    sampling = {name: draw(any_json) for name in draw(st.sets(st.sampled_from(SAMPLING_NAMES), max_size=4))}
    body["sampling_params"] = draw(st.just(sampling) | any_json)
    for name in draw(st.sets(st.sampled_from(TOP_KEYS[2:]), max_size=4)):
        body[name] = draw(any_json)
    return body


@given(
    bodies(), st.dictionaries(st.sampled_from(["X-Request-Id", "X-data-parallel-rank"]), st.text(max_size=5))
)
def test_any_body_is_answered_never_raised(body: dict[str, Any], headers: dict[str, str]) -> None:
    call = parse(body, {**JSON_HEADERS, **headers})
    if isinstance(call, HttpReply):
        error = error_of(call)
        assert 400 <= error["code"] < 500
    else:
        assert len(call.requests) == 1
        call.requests[0].SerializeToString()  # every value fits its field


@given(st.binary(max_size=40) | any_json.map(lambda v: json.dumps(v).encode()))
def test_any_abort_body_is_answered(body: bytes) -> None:
    answer = FORMAT.parse_abort(ABORT, body, {})
    if isinstance(answer, HttpReply):
        assert error_of(answer)["code"] == 400
    else:
        assert all(i.startswith("generate-tokens-") for i in answer.request_ids)
