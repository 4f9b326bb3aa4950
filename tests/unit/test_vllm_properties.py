"""Properties of the vLLM conversion that must hold whatever the engine or frontend sends."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_vllm.convert import ResponseState, to_generate_request
from tests.vllm_fixtures import chunk, complete, servicer_stream

Resp: TypeAlias = vllm_engine_pb2.GenerateResponse
token = st.integers(0, 2**32 - 1)
deltas = st.lists(st.lists(token, max_size=4), min_size=1, max_size=6)
MODES: tuple[DisaggregationMode, ...] = ("agg", "prefill", "decode")


def _req(n: int) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(token_ids=[1, 2])
    req.sampling_options.n = n
    return req


@st.composite
def interleaved(draw: st.DrawFn) -> tuple[list[list[list[int]]], list[Resp]]:
    """n choices streamed the servicer's way, their messages interleaved in any order."""
    n = draw(st.integers(1, 3))
    per_choice = [draw(deltas) for _ in range(n)]
    queues = [
        servicer_stream(d, draw(st.sampled_from(["stop", "length", "abort"])), i)
        for i, d in enumerate(per_choice)
    ]
    msgs: list[Resp] = []
    while any(queues):
        i = draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
        msgs.append(queues[i].pop(0))
    return per_choice, msgs


@given(interleaved())
def test_deltas_concatenate_to_the_engines_output_and_each_choice_ends_once(
    case: tuple[list[list[list[int]]], list[Resp]],
) -> None:
    per_choice, msgs = case
    state = ResponseState(_req(len(per_choice)), "agg")
    outs = [o for m in msgs for o in state.feed(m)]
    assert state.finished
    for i, d in enumerate(per_choice):
        mine = [o for o in outs if o.index == i]
        expected = [t for step in d for t in step]
        assert [t for o in mine for t in o.token_ids] == expected
        terminals = [o for o in mine if o.finish_reason != sidecar_pb2.UNSPECIFIED]
        assert len(terminals) == 1
        assert terminals[0] is mine[-1]
        assert terminals[0].completion_usage.completion_tokens == len(expected)
        assert all(o.token_ids or o.finish_reason for o in mine), "no empty non-terminal chunks"


@given(deltas, st.integers(0, 5))
def test_a_cumulative_complete_never_repeats_or_drops_a_token(
    d: list[list[int]], streamed_steps: int
) -> None:
    everything = [t for step in d for t in step]
    msgs = [chunk(step) for step in d[:streamed_steps]]
    msgs.append(complete(everything, "length"))
    state = ResponseState(_req(1), "agg")
    outs = [o for m in msgs for o in state.feed(m)]
    assert [t for o in outs for t in o.token_ids] == everything


@given(interleaved(), st.lists(st.integers(0, 40), max_size=5))
def test_messages_after_every_terminal_change_nothing(
    case: tuple[list[list[list[int]]], list[Resp]], extra_ids: list[int]
) -> None:
    per_choice, msgs = case
    state = ResponseState(_req(len(per_choice)), "agg")
    for m in msgs:
        state.feed(m)
    for i in range(len(per_choice)):
        assert state.feed(chunk(extra_ids, i)) == []
        assert state.feed(complete(extra_ids, "stop", i)) == []


# ------------------------------------------------------------ absent is not zero (request)

# (public location, value to set, wire field, neutral value when absent or None if the wire has presence)
OPTIONAL_FIELDS: list[tuple[str, str, Any, str, Any]] = [
    ("sampling_options", "temperature", 0.0, "temperature", None),
    ("sampling_options", "seed", 0, "seed", None),
    ("stop_conditions", "max_tokens", 3, "max_tokens", None),
    ("output_options", "logprobs", 0, "logprobs", None),
    ("output_options", "prompt_logprobs", 0, "prompt_logprobs", None),
    ("sampling_options", "min_p", 0.5, "min_p", 0.0),
    ("sampling_options", "top_p", 0.5, "top_p", 1.0),
    ("sampling_options", "presence_penalty", 0.5, "presence_penalty", 0.0),
    ("sampling_options", "frequency_penalty", 0.5, "frequency_penalty", 0.0),
    ("sampling_options", "repetition_penalty", 0.5, "repetition_penalty", 1.0),
    ("stop_conditions", "min_tokens", 2, "min_tokens", 0),
    ("output_options", "skip_special_tokens", False, "skip_special_tokens", True),
    ("stop_conditions", "ignore_eos", True, "ignore_eos", False),
    ("sampling_options", "include_stop_str_in_output", True, "include_stop_str_in_output", False),
    ("sampling_options", "top_k", 5, "top_k", 0),
    ("sampling_options", "n", 2, "n", 1),
]


@given(st.sets(st.integers(0, len(OPTIONAL_FIELDS) - 1)))
def test_absent_stays_absent_and_given_values_are_carried(chosen: set[int]) -> None:
    req = sidecar_pb2.PreprocessedRequest(token_ids=[1])
    for i in chosen:
        group, name, value, _, _ = OPTIONAL_FIELDS[i]
        setattr(getattr(req, group), name, value)
    p = to_generate_request(req, "p", mode="agg", supports_vision=False).sampling_params
    for i, (_, _, value, wire, neutral) in enumerate(OPTIONAL_FIELDS):
        if neutral is None:
            assert p.HasField(wire) == (i in chosen), wire
            if i in chosen:
                assert getattr(p, wire) == value, wire
        else:
            assert getattr(p, wire) == (value if i in chosen else neutral), wire


# ------------------------------------------------------------- robustness to engine garbage

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def logprobs(draw: st.DrawFn) -> vllm_engine_pb2.OutputLogProbs:
    lp = vllm_engine_pb2.OutputLogProbs(
        token_ids=draw(st.lists(token, max_size=3)), token_logprobs=draw(st.lists(floats, max_size=3))
    )
    for _ in range(draw(st.integers(0, 3))):
        lp.top_logprobs.add(
            token_ids=draw(st.lists(token, max_size=2)), values=draw(st.lists(floats, max_size=2))
        )
    return lp


@st.composite
def input_logprobs(draw: st.DrawFn) -> vllm_engine_pb2.InputLogProbs:
    lp = vllm_engine_pb2.InputLogProbs(token_ids=draw(st.lists(token, max_size=3)))
    for value in draw(st.lists(st.none() | floats, max_size=3)):
        lp.token_logprobs.add() if value is None else lp.token_logprobs.add(value=value)
    for _ in range(draw(st.integers(0, 3))):
        lp.top_logprobs.add(
            token_ids=draw(st.lists(token, max_size=2)), values=draw(st.lists(floats, max_size=2))
        )
    return lp


json_text = st.one_of(
    st.text(max_size=20),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    ).map(json.dumps),
)


@st.composite
def engine_message(draw: st.DrawFn) -> Resp:
    index = draw(st.integers(0, 3))
    ids = draw(st.lists(token, max_size=4))
    if draw(st.booleans()):
        c = vllm_engine_pb2.GenerateStreamChunk(
            token_ids=ids,
            index=index,
            prompt_tokens=draw(st.integers(0, 9)),
            cached_tokens=draw(st.integers(0, 9)),
        )
        if draw(st.booleans()):
            c.output_logprobs.CopyFrom(draw(logprobs()))
        if draw(st.booleans()):
            c.input_logprobs.CopyFrom(draw(input_logprobs()))
        return Resp(chunk=c)
    reason = draw(st.sampled_from(["stop", "length", "abort", "error"]) | st.text(max_size=5))
    d = vllm_engine_pb2.GenerateComplete(output_ids=ids, finish_reason=reason, index=index)
    if draw(st.booleans()):
        d.output_logprobs.CopyFrom(draw(logprobs()))
    if draw(st.booleans()):
        d.kv_transfer_params_json = draw(json_text)
    which = draw(st.sampled_from([None, "token", "str"]))
    if which == "token":
        d.matched_token_id = draw(token)
    elif which == "str":
        d.matched_stop_str = draw(st.text(max_size=3))
    return Resp(complete=d)


@settings(max_examples=300)
@given(
    st.lists(engine_message() | st.just(Resp()), max_size=8),
    st.sampled_from(MODES),
    st.integers(1, 3),
    st.none() | st.integers(0, 3),
    st.booleans(),
)
def test_arbitrary_engine_messages_only_ever_raise_sidecar_errors(
    msgs: list[Resp], mode: DisaggregationMode, n: int, want_logprobs: int | None, want_prompt: bool
) -> None:
    req = _req(n)
    if want_logprobs is not None:
        req.output_options.logprobs = want_logprobs
    if want_prompt:
        req.output_options.prompt_logprobs = 1
    state = ResponseState(req, mode)
    terminals: dict[int, int] = {}
    try:
        for m in msgs:
            for out in state.feed(m):
                assert out.index < n
                assert len(out.log_probs) in (0, len(out.token_ids))
                if out.finish_reason != sidecar_pb2.UNSPECIFIED:
                    terminals[out.index] = terminals.get(out.index, 0) + 1
    except SidecarError:
        pass
    assert all(count == 1 for count in terminals.values())


# ------------------------------------------------------------- robustness to frontend input

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def frontend_request(draw: st.DrawFn) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(token_ids=draw(st.lists(token, max_size=3)))
    s, stop, out, r = req.sampling_options, req.stop_conditions, req.output_options, req.routing
    u32, i32, i64 = (
        st.integers(0, 2**32 - 1),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(-(2**63), 2**63 - 1),
    )
    f32 = st.floats(width=32)
    optional: list[tuple[Any, str, st.SearchStrategy[Any]]] = [
        *((s, name, u32) for name in ("n", "best_of")),
        *((s, name, f32) for name in ("temperature", "top_p", "min_p", "presence_penalty")),
        *((s, name, f32) for name in ("frequency_penalty", "repetition_penalty", "length_penalty")),
        (s, "top_k", i32),
        (s, "seed", i64),
        *((s, name, st.booleans()) for name in ("use_beam_search", "include_stop_str_in_output")),
        *((stop, name, u32) for name in ("max_tokens", "min_tokens")),
        (stop, "ignore_eos", st.booleans()),
        *((out, name, u32) for name in ("logprobs", "prompt_logprobs")),
        (out, "skip_special_tokens", st.booleans()),
        *((r, name, u32) for name in ("dp_rank", "prefill_dp_rank")),
        *((r, name, st.text(max_size=2)) for name in ("lora_name", "cache_namespace")),
        (r, "priority", i32),
    ]
    for message, name, values in optional:
        if draw(st.booleans()):
            setattr(message, name, draw(values))
    stop.stop_token_ids.extend(draw(st.lists(token, max_size=2)))
    stop.stop_token_ids_hidden.extend(draw(st.lists(token, max_size=2)))
    for key, bias in draw(st.dictionaries(token, f32, max_size=2)).items():
        s.logit_bias[key] = bias
    guided = draw(st.sampled_from([None, "json", "regex", "choice"]))
    if guided == "json":
        s.guided_decoding.json = draw(st.text(max_size=8) | json_values.map(json.dumps))
    elif guided == "regex":
        s.guided_decoding.regex = draw(st.text(max_size=3))
    elif guided == "choice":
        s.guided_decoding.choice.choices.extend(draw(st.lists(st.text(max_size=2), max_size=2)))
    if draw(st.booleans()):
        req.extra_args.update(
            draw(st.dictionaries(st.sampled_from(["kv_transfer_params", "x"]), json_values))
        )
    if draw(st.booleans()):
        req.prefill_result.disaggregated_params.update(
            draw(st.dictionaries(st.text(max_size=12), json_values))
        )
    for kind in draw(st.lists(st.integers(0, 3), max_size=2)):
        req.multi_modal_data.add(kind=kind, url=draw(st.text(max_size=3)))
    return req


@settings(max_examples=300)
@given(frontend_request(), st.sampled_from(MODES), st.booleans())
def test_arbitrary_requests_convert_or_raise_invalid_argument_only(
    req: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode, vision: bool
) -> None:
    refusal: SidecarError | None = None
    try:
        native = to_generate_request(req, "p", mode=mode, supports_vision=vision)
    except SidecarError as err:
        refusal = err
    if refusal is not None:
        assert refusal.reason is FailureReason.INVALID_ARGUMENT
        return
    assert native.request_id == "p"
    assert list(native.tokenized.input_ids) == list(req.token_ids)
    if native.HasField("kv_transfer_params_json"):
        assert isinstance(json.loads(native.kv_transfer_params_json, parse_constant=_no_constant), dict)
    if native.sampling_params.WhichOneof("constraint") == "json_schema":
        json.loads(native.sampling_params.json_schema, parse_constant=_no_constant)


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} sent to the engine as JSON")
